"""qgZ error feedback: each rank keeps the int4 quantization error of its last send per gradient
and adds it back to the next one, so the compressed gradient is unbiased over time (LoCo-style).

The state lives here, outside the compiled graphs: a functional backward graph cannot own
persistent tensors. Two custom ops reach it, each opaque to Inductor:
    err = zpp.ef_load(like, slot)        a copy of the stored error (zeros the first time)
    done = zpp.ef_store(residual, slot)  stores a copy, returns a 0-dim zero
The qgz pass adds `done` to the reduced gradient, so the store is never dead code, and the load
feeds the store, so they run in order. Errors are kept in bfloat16: the state is about the size
of one unsharded gradient copy per rank (2 bytes x parameters x (1 + 1/ranks_per_node)), half of
what fp32 would take.

Slots belong to a compiled graph, not to a parameter: a recompiled graph gets fresh slots (its
error starts at zero; the old graph's state stays until clear_error_feedback()), and a graph that
Dynamo reuses for several modules in one backward is refused (SharedErrorSlotError). Errors are
stored in the units of the gradient: with a loss scaler, a scale change makes the carried error
off by that factor for one step.

Slots are numbered per model (per shard() call, its plan id) in the order its graphs create them,
which is the same in every run of the same training script: a checkpoint saves a model's errors
by that number (error_state) and a resumed run puts them back (restore_error_state) before its
graphs are compiled, so the recompiled graphs pick them up.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch import Tensor

STATE_DTYPE = torch.bfloat16

_ERRORS: dict[int, Tensor] = {}
_STORED_IN: dict[int, int] = {}  # slot -> the autograd graph task (one backward call) that stored it
_SLOTS: dict[int, Iterator[int]] = {}  # plan id -> the numbers of its next slots
SLOTS_PER_PLAN = 1 << 20  # slot = plan id * SLOTS_PER_PLAN + its number within the plan


class SharedErrorSlotError(RuntimeError):
    pass


def new_slot(plan_id: int = -1) -> int:
    """A fresh state slot of the model `plan_id`, one per quantization point of a compiled graph
    (-1: slots of no model, for tests of the kernels)."""
    index = next(_SLOTS.setdefault(plan_id, itertools.count()))
    return (plan_id + 1) * SLOTS_PER_PLAN + index


def error_state(plan_id: int) -> dict[int, Tensor]:
    """The stored errors of the model `plan_id`, by slot number within it (for checkpoints)."""
    first = (plan_id + 1) * SLOTS_PER_PLAN
    return {slot - first: t for slot, t in _ERRORS.items() if first <= slot < first + SLOTS_PER_PLAN}


def restore_error_state(plan_id: int, errors: dict[int, Tensor]) -> None:
    """Put back errors saved by error_state (from another process too) for the model `plan_id`."""
    first = (plan_id + 1) * SLOTS_PER_PLAN
    for index, t in errors.items():
        _ERRORS[first + int(index)] = t.detach().to(STATE_DTYPE).clone()


def clear_error_feedback() -> None:
    """Drop every stored error (e.g. between unrelated runs)."""
    _ERRORS.clear()
    _STORED_IN.clear()


def stored_error_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _ERRORS.values())


@torch.library.custom_op("zpp::ef_load", mutates_args=())
def ef_load(like: Tensor, slot: int) -> Tensor:
    stored = _ERRORS.get(slot)
    if stored is None or stored.shape != like.shape:
        return torch.zeros_like(like)
    return stored.to(like.dtype)  # a new tensor: the stored one is never handed to a graph


@ef_load.register_fake
def _(like: Tensor, slot: int) -> Tensor:
    return torch.empty_like(like)


@torch.library.custom_op("zpp::ef_store", mutates_args=())
def ef_store(residual: Tensor, slot: int) -> Tensor:
    _refuse_sharing(slot)
    # A non-finite residual (an inf/nan gradient, e.g. a GradScaler overflow step) is dropped:
    # fed back, it would make every later step of that block nan.
    residual = torch.where(torch.isfinite(residual), residual, torch.zeros_like(residual))
    _ERRORS[slot] = residual.detach().to(STATE_DTYPE)
    return residual.new_zeros(())


def _refuse_sharing(slot: int) -> None:
    """One compiled graph serving several modules (per-layer compile, a graph break inside a
    repeated block) would run one slot for several parameters in one backward: refuse it."""
    task = torch._C._current_graph_task_id()
    if task != -1 and _STORED_IN.get(slot) == task:
        raise SharedErrorSlotError(
            "qgZ error feedback: one compiled graph reduced the gradients of several modules in one "
            "backward, so they would share error state. Compile the whole model once (no per-layer "
            "torch.compile, no graph break inside a repeated block), or set qgz_error_feedback=False."
        )
    _STORED_IN[slot] = task


@ef_store.register_fake
def _(residual: Tensor, slot: int) -> Tensor:
    return residual.new_empty(())
