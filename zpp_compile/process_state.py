"""zpp_compile's process-global state, and zpp_compile.reset(), the one call that clears it.

Several modules keep state for the whole process: the compiled-graph records (backend), the
communication counter (comm), the layout shard() used (topology), qgZ's error-feedback errors and
slot keys (error_feedback), the sharded subclasses (sharding), the schedule check's checked-run
counter (schedule_check), the no_sync gradient buffers (grad_sync). Each such module registers the
function that clears its state here, at import:

    register_reset(clear_my_state)

so reset() clears every one of them, and new state joins it in one line. This module imports
nothing of zpp_compile's (every module may import it).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["register_reset", "reset"]

_CLEARS: list[Callable[[], None]] = []


def register_reset(clear: Callable[[], None]) -> Callable[[], None]:
    """Have zpp_compile.reset() call `clear` (no arguments), after the ones registered before it.
    Returns `clear`, so it also works as a decorator."""
    if clear not in _CLEARS:
        _CLEARS.append(clear)
    return clear


def reset() -> None:
    """Forget everything zpp_compile holds for the process: the next model shards and compiles as
    in a fresh process.

    Clears torch.compile's caches (torch._dynamo.reset(): every compiled frame of the process, not
    only zeropp ones; graphs compiled before would otherwise keep the error-feedback slots and
    buffers of the state cleared here), the compiled-graph records (compiled_graphs()), the
    communication counter, the layout the first shard() fixed (so the next shard() may use another
    ranks_per_node), qgZ's stored errors and slot keys, no_sync's accumulated gradients, the
    sharded subclasses, and the schedule check's count of checked runs (and its setting).

    Kept: the process groups zpp_compile created (and the DTensor meshes over them): they belong to
    the default process group, making one is collective, and the next model with the same ranks
    and timeout reuses them. Model numbers (plan ids) and graph numbers keep counting, so no model
    sharded after reset() shares state with one sharded before. State that lives only while a
    call runs (the forward depth, the running graph's parameter names) is not touched.

    Call it between unrelated models or tests in one process (every rank alike, since what it clears
    decides which collectives run). Not while a model is in use: a model sharded before it still
    works, but recompiles, and its qgZ error feedback and pending no_sync gradients are dropped.
    """
    import torch._dynamo

    torch._dynamo.reset()
    for clear in _CLEARS:
        clear()
