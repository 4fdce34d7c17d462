"""Turning a failed collective into an error that says what happened and what to do.

A rank that dies makes its peers' next collective fail at once (the connection closes); a rank
that never reaches a collective makes them fail when the collective timeout expires. Either way
the backend's raw error ("Connection reset by peer", "Timed out waiting 8000ms for send") names
neither the graph nor the cause; `CollectiveError` does, and keeps the raw error as its cause.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Iterator, Optional

import torch.distributed as dist

# Substrings of the errors gloo and NCCL raise when a peer is gone or late.
_COMMUNICATION_FAILURES = (
    "gloo/",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, or did not reach it within the collective timeout."""


def is_communication_failure(error: BaseException) -> bool:
    if isinstance(error, CollectiveError):
        return False  # already explained
    if isinstance(error, getattr(dist, "DistBackendError", ())):
        return True
    return isinstance(error, RuntimeError) and any(p in str(error) for p in _COMMUNICATION_FAILURES)


def _explained_error(error: BaseException, where: str, timeout_s: Optional[float]) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    limit = (
        f"Config(collective_timeout_s={timeout_s:g})"
        if timeout_s is not None
        else "the process group's timeout (torch.distributed.init_process_group(timeout=...))"
    )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CollectiveError(
        f"rank {rank}: a collective in {where} failed: another rank died, or did not reach the same "
        f"collective within {limit}. Look in the other ranks' logs for the first error. If every "
        "rank is alive: a sharded model's forward is collective, so a forward or generate() that only "
        "some ranks run (evaluation or samples under `if rank == 0:`), or a different number of forwards "
        "per rank (an uneven evaluation split), waits here: run it on every rank. If one rank is only "
        "slow (a long first compile, uneven data loading), raise "
        f"Config(collective_timeout_s=...). Backend error: {first_line}"
    )


@contextlib.contextmanager
def explained_collective_failures(where: str, timeout_s: Optional[float]) -> Iterator[None]:
    """Re-raise a communication failure inside the block as a CollectiveError naming `where`."""
    try:
        yield
    except RuntimeError as error:
        if is_communication_failure(error):
            raise _explained_error(error, where, timeout_s) from error
        raise


# What "never time out" (collective_timeout_s=inf) becomes: process groups take a finite timeout.
NO_TIMEOUT = datetime.timedelta(days=3650)


def as_timedelta(timeout_s: Optional[float]) -> Optional[datetime.timedelta]:
    if timeout_s is None:
        return None
    return NO_TIMEOUT if math.isinf(timeout_s) else datetime.timedelta(seconds=timeout_s)
