"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

from typing import Callable


def step_peak_bytes(step: Callable[[], None]) -> int:
    """The highest live bytes allocated during step() over what was live before it, from
    torch.profiler's memory records (CPU: the only allocator statistics there are)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for record in sorted(records, key=lambda r: r.start_ns()):
        live += record.nbytes()
        peak = max(peak, live)
    return peak
