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
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

STATE_DTYPE = torch.bfloat16

_ERRORS: dict[int, Tensor] = {}
_STORED_IN: dict[int, int] = {}  # slot -> the autograd graph task (one backward call) that stored it
_SLOTS = itertools.count()


class SharedErrorSlotError(RuntimeError):
    pass


def new_slot() -> int:
    """A fresh state slot, one per quantization point of a compiled graph."""
    return next(_SLOTS)


def clear_error_feedback() -> None:
    """Drop every stored error (e.g. after loading a checkpoint, or between unrelated runs)."""
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
