"""Debug mode (Config.check_schedule / ZPP_CHECK_SCHEDULE=1): compare collective schedules across ranks.

Every rank must issue the same collectives in the same order; if one rank's graph differs (another
Config, a graph break on one rank only, a data-dependent branch), the collectives pair up wrongly
and training hangs or silently mixes tensors. Before a compiled graph first runs, each rank sends
the fingerprint of its schedule (op, group, dtype, element count of each collective) to all others;
a difference raises ScheduleMismatchError on every rank, naming the first differing collective. A
rank that never arrives is reported by gloo's monitored_barrier after CHECK_TIMEOUT instead.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from .comm import Collective

CHECK_TIMEOUT = datetime.timedelta(seconds=300)  # covers a slower rank still compiling its graph

Fingerprint = tuple[str, tuple[int, ...], str, int]


class ScheduleMismatchError(RuntimeError):
    pass


def fingerprint(collectives: Sequence[Collective]) -> list[Fingerprint]:
    return [(c.op, c.group_ranks, str(c.dtype).removeprefix("torch."), c.input_numel) for c in collectives]


def check_schedule(collectives: Sequence[Collective], label: str) -> None:
    """Raise ScheduleMismatchError unless every rank's graph issues these same collectives (collective)."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=CHECK_TIMEOUT, wait_all_ranks=True)
    schedules: list = [None] * dist.get_world_size()
    dist.all_gather_object(schedules, (label, fingerprint(collectives)))
    message = describe_mismatch(schedules)
    if message:
        raise ScheduleMismatchError(message)


def describe_mismatch(schedules: list[tuple[str, list[Fingerprint]]]) -> Optional[str]:
    """None when all ranks' schedules agree; else which rank differs from rank 0, and where first."""
    label0, reference = schedules[0]
    for rank, (label, schedule) in enumerate(schedules[1:], start=1):
        if schedule == reference:
            continue
        index = next((i for i, (a, b) in enumerate(zip(reference, schedule)) if a != b), min(len(reference), len(schedule)))
        return (
            f"collective schedules differ between ranks: collective #{index} is "
            f"{_describe(reference, index)} on rank 0 ({label0}) but {_describe(schedule, index)} on rank {rank} "
            f"({label}); rank 0 issues {len(reference)} collectives in this graph, rank {rank} {len(schedule)}. "
            "Every rank must compile the same graph: use the same Config and model on every rank, and "
            "avoid rank-dependent control flow or graph breaks inside the compiled model."
        )
    return None


def _describe(schedule: list[Fingerprint], index: int) -> str:
    if index >= len(schedule):
        return "absent (the graph has ended)"
    op, ranks, dtype, numel = schedule[index]
    return f"{op} of {numel} {dtype} over ranks {list(ranks)}"
