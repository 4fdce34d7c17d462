"""qgZ error feedback: each rank keeps the int4 quantization error of its last send per gradient
and adds it back to the next one, so the compressed gradient is unbiased over time (LoCo-style).

The state lives here, outside the compiled graphs: a functional backward graph cannot own
persistent tensors. Two custom ops reach it, each opaque to Inductor:
    err = zpp.ef_load(like, slot)              a copy of the stored error (zeros the first time)
    done = zpp.ef_store(residual, slot, beta)  stores beta * stored + (1 - beta) * residual
                                               (Config.qgz_error_beta), returns a 0-dim zero
The qgz pass adds `done` to the reduced gradient, so the store is never dead code, and the load
feeds the store, so they run in order. Errors are kept in bfloat16: the state is about the size
of one unsharded gradient copy per rank (2 bytes x parameters x (1 + 1/ranks_per_node)), half of
what fp32 would take.

A slot belongs to a quantization point of a model's gradients: its key names the model (the
plan id of its shard() call), the bucket (its first parameter's name and its length) and the
stage. A recompiled graph (new shapes, a guard failure) reduces the same bucket into the same
slot, so its error carries over instead of restarting at zero, and the key is the same in every
run of the same script, which is what a checkpoint saves the errors under (error_state) and a
resumed run puts them back by (restore_error_state), whatever order its graphs compile in. A
graph that Dynamo reuses for several modules in one backward would store one slot twice and is
refused (SharedErrorSlotError). Errors are stored in the units of the gradient: with a loss
scaler, a scale change makes the carried error off by that factor for one step.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch
from torch import Tensor

from .process_state import register_reset

STATE_DTYPE = torch.bfloat16

_ERRORS: dict[int, Tensor] = {}
_STORED_IN: dict[int, int] = {}  # slot -> the autograd graph task (one backward call) that stored it
_NUMBERS: Iterator[int] = itertools.count()  # slots are ints: what a custom op's schema carries
_SLOT_OF: dict[tuple[int, str], int] = {}  # (plan id, key) -> slot
_KEY_OF: dict[int, tuple[int, str]] = {}  # slot -> (plan id, key)


class SharedErrorSlotError(RuntimeError):
    pass


def new_slot(plan_id: int = -1, key: Optional[str] = None) -> int:
    """The state slot of the quantization point `key` of the model `plan_id`: the same slot for
    the same key, however many graphs ask. Without a key, a slot of its own (kernel tests)."""
    if key is None:
        return next(_NUMBERS)
    if (plan_id, key) not in _SLOT_OF:
        slot = next(_NUMBERS)
        _SLOT_OF[(plan_id, key)], _KEY_OF[slot] = slot, (plan_id, key)
    return _SLOT_OF[(plan_id, key)]


def error_state(plan_id: int) -> dict[str, Tensor]:
    """The stored errors of the model `plan_id`, by slot key (for checkpoints)."""
    return {_KEY_OF[slot][1]: t for slot, t in _ERRORS.items() if _KEY_OF.get(slot, (None,))[0] == plan_id}


def restore_error_state(plan_id: int, errors: dict[str, Tensor]) -> None:
    """Put back errors saved by error_state (from another process too) for the model `plan_id`."""
    for key, t in errors.items():
        _ERRORS[new_slot(plan_id, key)] = t.detach().to(STATE_DTYPE).clone()


def clear_error_feedback() -> None:
    """Drop every stored error (e.g. between unrelated runs)."""
    _ERRORS.clear()
    _STORED_IN.clear()


@register_reset
def _forget_errors_and_slots() -> None:
    """zpp_compile.reset(): the errors and the slot keys (compiled graphs are gone too)."""
    clear_error_feedback()
    _SLOT_OF.clear()
    _KEY_OF.clear()


def stored_error_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _ERRORS.values())


def _stored_error(slot: int, shape: torch.Size) -> Optional[Tensor]:
    """The error stored in `slot` if it has `shape` (a recompiled graph may bucket otherwise)."""
    stored = _ERRORS.get(slot)
    return stored if stored is not None and stored.shape == shape else None


@torch.library.custom_op("zpp::ef_load", mutates_args=())
def ef_load(like: Tensor, slot: int) -> Tensor:
    stored = _stored_error(slot, like.shape)
    if stored is None:
        return like.new_zeros(like.shape)
    # A new tensor (the stored one is never handed to a graph), contiguous whatever `like`'s
    # layout: Inductor checks the strides against the fake kernel's, and may lay out `like` (a
    # transposed view in the pass) otherwise than the traced graph did.
    return stored.to(like.dtype, memory_format=torch.contiguous_format, copy=True)


@ef_load.register_fake
def _(like: Tensor, slot: int) -> Tensor:
    return like.new_empty(like.shape)


@torch.library.custom_op("zpp::ef_store", mutates_args=())
def ef_store(residual: Tensor, slot: int, beta: float = 0.0) -> Tensor:
    """Store beta * the stored error + (1 - beta) * `residual` (this step's error) in `slot`."""
    _refuse_sharing(slot)
    # A non-finite residual (an inf/nan gradient, e.g. a GradScaler overflow step) is dropped:
    # fed back, it would make every later step of that block nan.
    error = torch.where(torch.isfinite(residual), residual, torch.zeros_like(residual))
    if beta:  # nothing stored yet counts as zeros, as LoCo's buffer starts
        stored = _stored_error(slot, error.shape)
        error = torch.lerp(error.float(), torch.zeros(()) if stored is None else stored.float(), beta)
    _ERRORS[slot] = error.detach().to(STATE_DTYPE)
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
def _(residual: Tensor, slot: int, beta: float = 0.0) -> Tensor:
    return residual.new_empty(())
