"""The schedule check: every rank must issue the same collectives, of the same parameters, in order.

If one rank's graph differs (a rank-dependent branch, a graph break on one rank only), collectives
pair up wrongly: they hang, abort on a size mismatch, or, worst, silently mix two parameters of
the same shape. Config.check_schedule compares, before each checked compiled-graph run and each
checked eager collective, a digest of what it is about to issue: its collectives (op, group,
dtype, size) and the parameters they carry, by name. A difference raises ScheduleMismatchError
on every rank, naming the first differing collective and its parameter.

The digest travels in a small all-gather that *every* checked run issues, whichever graph it is:
a rank that recompiled (an uneven last batch) runs another graph than its peers but issues the
same collectives, and its digest all-gather pairs with theirs. (A separate barrier before a
graph's first run, as before, paired with a peer's data collective instead and hung.) Ranks count
checked runs alike, so they agree on which runs carry a digest: Config.check_schedule=N checks the
first N runs of the process (the default, cheap), True every run (debug), False none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .compat import all_gather_single
from .process_state import register_reset


class ScheduleMismatchError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One entry of a schedule: a collective and the parameter(s) it carries ("" when unknown).

    The group is described by its size: subgroups (hpZ, node, cross-node) hold other ranks on
    every rank but play the same part."""

    op: str
    group_size: int
    dtype: str
    numel: int
    params: tuple[str, ...] = ()

    def describe(self) -> str:
        what = f" of {', '.join(repr(p) for p in self.params)}" if self.params else ""
        return f"{self.op}{what} ({self.numel} {self.dtype}, group of {self.group_size} ranks)"


def input_placeholder(position: int) -> str:
    """Stands for the parameter passed as graph input `position`, named when the graph runs."""
    return f"{_INPUT_PREFIX}{position}"


_INPUT_PREFIX = "<graph input>"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What one compiled graph run (or one eager collective) issues, as every rank must agree on."""

    label: str
    entries: tuple[ScheduledCollective, ...]

    def named(self, names: dict[int, str]) -> Schedule:
        """This schedule with graph-input placeholders replaced by the names of this call's parameters."""
        if not names:
            return self
        return dataclasses.replace(self, entries=tuple(_named(e, names) for e in self.entries))

    @property
    def digest(self) -> tuple[int, int]:
        raw = hashlib.sha256(repr(self.entries).encode()).digest()
        return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True)


def _named(entry: ScheduledCollective, names: dict[int, str]) -> ScheduledCollective:
    params = tuple(
        names.get(int(p[len(_INPUT_PREFIX) :]), p) if p.startswith(_INPUT_PREFIX) else p for p in entry.params
    )
    return dataclasses.replace(entry, params=params)


_CALL_NAMES: list[dict[int, str]] = []  # the parameter names of the compiled calls running now


@contextlib.contextmanager
def parameter_names(names: dict[int, str]):
    """While a compiled graph is called: the names of the parameters at its input positions."""
    _CALL_NAMES.append(names)
    try:
        yield
    finally:
        _CALL_NAMES.pop()


def current_parameter_names() -> dict[int, str]:
    return _CALL_NAMES[-1] if _CALL_NAMES else {}


class _CheckedRuns:
    """How many runs this process checked, and how many it checks (None: every run)."""

    def __init__(self) -> None:
        self.done = 0
        self.limit: Optional[int] = 0

    def configure(self, setting: bool | int) -> None:
        """Take the most checking any sharded model of the process asked for."""
        if setting is True or self.limit is None:
            self.limit = None
        else:
            self.limit = max(self.limit, int(setting))

    def pending(self) -> bool:
        """Whether any run is still to be checked (so its parameters' names are worth looking up)."""
        return self.limit is None or self.done < self.limit

    def take(self) -> bool:
        """Whether the next run is checked (counted alike on every rank)."""
        if self.limit is not None and self.done >= self.limit:
            return False
        self.done += 1
        return True

    def reset(self) -> None:
        self.done, self.limit = 0, 0


CHECKED_RUNS = _CheckedRuns()
register_reset(CHECKED_RUNS.reset)


def maybe_check(schedule: Schedule, group_name: str, device: torch.device) -> None:
    """Check `schedule` against every rank's if this run is one of the checked ones (collective)."""
    if CHECKED_RUNS.take():
        check(schedule, group_name, device)


def check(schedule: Schedule, group_name: str, device: torch.device) -> None:
    """Raise ScheduleMismatchError on every rank unless every rank is about to issue `schedule`."""
    group = _resolve_process_group(group_name)
    world = dist.get_world_size(group)
    mine = torch.tensor(schedule.digest, dtype=torch.int64, device=device)
    everyone = torch.empty(2 * world, dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    if bool((everyone.view(world, 2) == mine).all()):
        return
    schedules: list = [None] * world
    dist.all_gather_object(schedules, schedule, group=group)  # every rank saw the difference
    raise ScheduleMismatchError(describe_mismatch(schedules) or "collective schedules differ between ranks")


def describe_mismatch(schedules: Sequence[Schedule]) -> Optional[str]:
    """None when all ranks' schedules agree; else which rank differs from rank 0, and where first."""
    reference = schedules[0]
    for rank, theirs in enumerate(schedules[1:], start=1):
        if theirs.entries == reference.entries:
            continue
        ours, other = reference.entries, theirs.entries
        index = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
        return (
            f"collective schedules differ between ranks: collective #{index} is {_describe(ours, index)} on "
            f"rank 0 ({reference.label}) but {_describe(other, index)} on rank {rank} ({theirs.label}); rank 0 "
            f"issues {len(ours)} collectives here, rank {rank} {len(other)}. Every rank must gather the "
            "same parameters in the same order: avoid rank-dependent control flow (a branch on data "
            "that differs between ranks choosing which layers run) and graph breaks on one rank only "
            "inside the model."
        )
    return None


def _describe(entries: Sequence[ScheduledCollective], index: int) -> str:
    return entries[index].describe() if index < len(entries) else "absent (the graph has ended)"
