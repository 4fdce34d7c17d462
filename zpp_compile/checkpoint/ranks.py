"""Work that one rank or every rank does for a checkpoint, with the outcome agreed by all ranks.

Saving and loading touch the file system between collectives (picking a folder, hashing files,
renaming). An error on one rank there must not leave the others waiting in the next collective
until it times out, so these helpers catch it, send it to every rank, and raise it everywhere:
every rank enters the same collectives in the same order, whatever happens.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def on_rank0(work: Callable[[], T]) -> T:
    """work() on rank 0; its result on every rank, or its error raised on every rank.

    Collective: one broadcast from rank 0 of the default process group.
    """
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        outcome[0] = _attempt(work)
    dist.broadcast_object_list(outcome, src=0)
    return _result_or_raise(outcome)[0]


def on_every_rank(work: Callable[[], T]) -> list[T]:
    """work() on every rank; the results of all ranks (by rank) on every rank, or the first
    rank's error raised on every rank.

    Collective: one all-gather of the default process group.
    """
    mine = _attempt(work)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    _result_or_raise([mine])  # this rank's own error first: it keeps its traceback
    return _result_or_raise(outcomes)


def _attempt(work: Callable[[], T]) -> tuple[bool, Any]:
    try:
        return True, work()
    except Exception as err:  # sent to the other ranks, raised on all of them below
        return False, _picklable(err)


def _picklable(err: Exception) -> Exception:
    """`err`, or a RuntimeError with its text where it cannot travel to the other ranks."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def _result_or_raise(outcomes: list[tuple[bool, Any]]) -> list[Any]:
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]
