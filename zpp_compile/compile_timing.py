"""Where a graph's compile time goes: seconds per stage, kept on its GraphRecord and logged.

Stages are named "<phase>/<what>": "dynamo/dedupe_gathers" (a pass on the Dynamo graph),
"joint/min_cut_partition", "forward/inductor", "backward/qgz", ... Summing every stage of a graph
gives the wall time of the backend on it: AOT_TRACE ("aot_autograd") holds AOTAutograd's own work
(tracing the joint graph, functionalization), i.e. the backend's wall time minus the stages inside
it. Dynamo's bytecode tracing happens before the backend is called and is not counted here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Optional

log = logging.getLogger("zpp_compile.compile_time")

AOT_TRACE = "aot_autograd"


class StageSeconds(dict):
    """{stage: seconds}, in the order stages first ran; adds up a stage that runs more than once.

    Exclusive times: a stage timed inside another is taken out of the outer one, so the stages of
    a graph add up to the wall time spent in them (AOT_TRACE is what AOTAutograd did around ours).
    """

    def __init__(self) -> None:
        super().__init__()
        self._children: list[float] = []  # for each open stage, the seconds of the stages inside it

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        self._children.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._children.pop()
            self[stage] = self.get(stage, 0.0) + elapsed - inner
            if self._children:
                self._children[-1] += elapsed

    def of_phase(self, phase: str) -> dict[str, float]:
        prefix = f"{phase}/"
        return {k[len(prefix) :]: v for k, v in self.items() if k.startswith(prefix)}


def summary(stages: dict[str, float], limit: int = 4) -> str:
    """ "12.3 s: forward/inductor 6.1 s, backward/inductor 4.0 s, ..." (the largest `limit` stages)."""
    largest = sorted(stages.items(), key=lambda kv: -kv[1])[:limit]
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in largest)
    return f"{sum(stages.values()):.2f} s ({parts})"


def fx_graph_cache_counts() -> tuple[int, int, int]:
    """Inductor's FX-graph cache (hits, misses, bypasses) in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"]


def aot_autograd_cache_counts() -> tuple[int, int, int]:
    """AOTAutograd's cache (hits, misses, bypasses) in this process so far."""
    from torch._dynamo.utils import counters

    aot = counters["aot_autograd"]
    return aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_bypass"]


def cache_outcome(before: tuple[int, int, int], after: tuple[int, int, int]) -> str:
    """What a cache did between two readings of its counters (fx_graph_cache_counts for one phase's
    Inductor compiles, aot_autograd_cache_counts for a graph): "hit", "miss" or "bypass" when all
    lookups (regions: see inductor_regions) had the same outcome, else the counts ("9 hit, 3
    miss"); "off" when nothing was looked up (caches disabled)."""
    counts = {kind: a - b for kind, a, b in zip(("hit", "miss", "bypass"), after, before) if a - b}
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "off"


def log_phase(graph_label: str, stages: StageSeconds, phase: str, cache: Optional[str] = None) -> None:
    """INFO: one line per compiled phase (forward, backward, inference) of a graph."""
    if log.isEnabledFor(logging.INFO):
        cached = f"; FX graph cache {cache}" if cache else ""
        log.info("zpp_compile: %s compiled in %s%s", graph_label, summary(stages.of_phase(phase)), cached)


def log_graph(graph_label: str, stages: StageSeconds, aot_cache: str) -> None:
    """INFO: the backend's whole time on a graph so far (a lazily compiled backward, where
    AOTAutograd's cache is not used, comes later), and what that cache did."""
    if log.isEnabledFor(logging.INFO):
        log.info("zpp_compile: %s: backend took %s; AOTAutograd cache %s", graph_label, summary(stages), aot_cache)
