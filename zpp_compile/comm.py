"""Communication accounting: the bytes each rank sends and receives, split intra- / inter-node.

The model is the logical, algorithm-independent one of the ZeRO++ paper: in an all-gather every
rank sends its input to every other member of the group; in a reduce-scatter or an even
all-to-all every rank sends each other member the 1/group part of its input meant for it. Where
the peer sits on another node (Topology.node_of) the bytes are inter-node. Ring or tree algorithms
move the same totals per rank; they only route them differently.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Iterable, Iterator, Literal, Optional

import torch
import torch.distributed as dist

from .process_state import register_reset
from .topology import Topology

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_to_all", "all_reduce"]
Phase = Literal["forward", "backward"]
Locality = Literal["intra", "inter"]
Direction = Literal["sent", "received"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as issued by this rank: what it is, where it runs, how much it carries."""

    op: CollectiveOp
    phase: Phase
    group_name: str
    group_ranks: tuple[int, ...]
    dtype: torch.dtype
    input_numel: int
    label: str = ""

    @property
    def input_bytes(self) -> int:
        return self.input_numel * self.dtype.itemsize

    @property
    def bytes_per_peer(self) -> int:
        """Bytes this rank sends to (and receives from) each other member of the group."""
        if self.op == "all_gather":
            return self.input_bytes
        if self.op == "all_reduce":  # a reduce-scatter and an all-gather of the result
            return 2 * self.input_bytes // len(self.group_ranks)
        return self.input_bytes // len(self.group_ranks)

    def bytes_by_locality(self, topology: Topology) -> dict[Locality, int]:
        """Bytes sent by this rank (equal to bytes received), split by where the peer sits."""
        return dict(_locality_split(self, topology))


@functools.lru_cache(maxsize=4096)
def _locality_split(c: Collective, topology: Topology) -> tuple[tuple[Locality, int], ...]:
    # Cached: a compiled graph records the same collectives on every run of the training loop.
    me = topology.rank
    peers = [r for r in c.group_ranks if r != me]
    intra = sum(1 for r in peers if topology.same_node(r, me))
    return (("intra", intra * c.bytes_per_peer), ("inter", (len(peers) - intra) * c.bytes_per_peer))


@functools.cache
def group_ranks(group_name: str) -> tuple[int, ...]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


class CommCounter:
    """Bytes sent and received by this rank, by phase, collective and locality.

    Eager collectives add themselves when they run; a compiled graph adds the collectives of its
    final (post-pass) graph each time it runs, so the count is what the executed graph issued.
    """

    def __init__(self) -> None:
        self._bytes: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
        self._calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._trace: Optional[list[Collective]] = None

    def record(self, collectives: Iterable[Collective], topology: Topology) -> None:
        for c in collectives:
            if self._trace is not None:
                self._trace.append(c)
            self._calls[(c.phase, c.op)] += 1
            for locality, nbytes in c.bytes_by_locality(topology).items():
                for direction in ("sent", "received"):
                    self._bytes[(c.phase, c.op, locality, direction)] += nbytes

    @contextlib.contextmanager
    def trace(self) -> Iterator[list[Collective]]:
        """Collect every collective recorded inside the block, in issue order."""
        outer, self._trace = self._trace, []
        try:
            yield self._trace
        finally:
            if outer is not None:
                outer.extend(self._trace)
            self._trace = outer

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def bytes(
        self,
        direction: Direction = "sent",
        *,
        phase: Optional[Phase] = None,
        op: Optional[CollectiveOp] = None,
        locality: Optional[Locality] = None,
    ) -> int:
        """Total bytes matching every filter given (None matches all)."""
        return sum(
            n
            for (p, o, loc, d), n in self._bytes.items()
            if d == direction and phase in (None, p) and op in (None, o) and locality in (None, loc)
        )

    def calls(self, *, phase: Optional[Phase] = None, op: Optional[CollectiveOp] = None) -> int:
        return sum(n for (p, o), n in self._calls.items() if phase in (None, p) and op in (None, o))

    def summary(self) -> str:
        rows = [f"{'phase':<9} {'collective':<15} {'calls':>6} {'intra MB':>10} {'inter MB':>10}"]
        for phase, op in sorted(self._calls):
            intra = self.bytes(phase=phase, op=op, locality="intra") / 1e6
            inter = self.bytes(phase=phase, op=op, locality="inter") / 1e6
            rows.append(f"{phase:<9} {op:<15} {self._calls[(phase, op)]:>6} {intra:>10.3f} {inter:>10.3f}")
        return "\n".join(rows)


_COUNTER = CommCounter()
register_reset(_COUNTER.reset)


def comm_counter() -> CommCounter:
    """This process's communication counter (sent bytes per step: reset, run a step, read)."""
    return _COUNTER
