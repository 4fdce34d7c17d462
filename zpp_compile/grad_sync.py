"""Gradient accumulation without a reduce per micro-batch (FSDP2's set_requires_gradient_sync).

    for micro in range(K):
        with zpp_compile.no_sync(model) if micro < K - 1 else contextlib.nullcontext():
            loss_fn(compiled(x[micro])).backward()
    optimizer.step()

Every backward normally reduce-scatters each parameter's gradient. Under no_sync the backward
adds each full (unsharded) gradient, in the reduce dtype, into a buffer zpp_compile keeps for that
parameter, and leaves `p.grad` untouched; the next synchronised backward adds the buffer to its
own gradient before the one reduction of the step (the buffer is then freed). With K micro-batches
the wire carries 1/K of the gradient bytes (int4 under qgZ: the single reduction is quantized),
at the cost of one unsharded gradient per parameter held between micro-batches.

How it reaches the graphs: the sync mode is read at forward time (ShardedState.grad_sync, through
the parameter property) and passed to the gather markers as the keyword `grad_sync`, so Dynamo
guards on it and a compiled model has at most three variants of each graph: "sync" (no keyword,
the graphs of a model that never accumulates), "accumulate" and "flush" (a synchronised step with
buffers pending). The markers' backward (ops.py) then calls
    zpp.accumulate_grad(grad, plan_id, fqn)           adds grad into the buffer; returns nothing,
                                                      registered as side-effectful (never DCE'd)
    g = zpp.flush_grad(grad, plan_id, fqn)            grad + the pending buffer (popped)
and the shard's gradient is None in accumulate mode; in flush mode `g` goes to the ordinary
zpp.reduce_grad / zpp.all_reduce_grad marker, so every lowering pass (qgZ included) sees the
graphs it always did. The parameter's name is a constant of the accumulate / flush graphs: a graph
Dynamo reuses for several modules (a graph break inside a loop over blocks) is specialised per
module in those two modes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import Tensor, nn

from .layout import ShardedState, sharded_state
from .process_state import register_reset

SYNC, ACCUMULATE, FLUSH = "sync", "accumulate", "flush"

_BUFFERS: dict[int, dict[str, Tensor]] = {}  # plan id -> parameter name -> accumulated full gradient
_STATES: weakref.WeakValueDictionary[int, ShardedState] = weakref.WeakValueDictionary()


class PendingGradientsError(RuntimeError):
    """A checkpoint was asked for while micro-batch gradients were accumulated and not yet reduced."""


def set_requires_gradient_sync(model: nn.Module, requires_sync: bool) -> None:
    """Whether the next backward passes of `model` reduce their gradients (FSDP2's method of the
    same name). False: each backward adds the full gradients into buffers kept by zpp_compile
    (one unsharded gradient per parameter, in the reduce dtype) and leaves `p.grad` untouched.
    True (the default): the next backward reduces its gradient plus the buffer, once, then frees it.

    Takes the sharded model or its torch.compile wrapper. Every rank must set the same value (it
    decides which collectives the backward issues). Set it before the forward: the mode is read
    when the parameters are gathered.
    """
    state = sharded_state(model)
    _STATES[state.plan_id] = state
    if not requires_sync:
        state.grad_sync = ACCUMULATE
    else:
        state.grad_sync = FLUSH if _BUFFERS.get(state.plan_id) or state.grad_sync == ACCUMULATE else SYNC


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside the block accumulate gradients locally, without communication; the
    first synchronised backward after it reduces them all at once (see set_requires_gradient_sync).

        with zpp_compile.no_sync(model):
            loss(compiled(x0)).backward()      # no reduce-scatter
        loss(compiled(x1)).backward()          # one reduce-scatter of both micro-batches' gradients
    """
    state = sharded_state(model)
    previous = state.grad_sync != ACCUMULATE
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, previous)


def grad_sync_kwargs(state: ShardedState, fqn: str) -> dict:
    """The marker keywords for a parameter read in forward: none in sync mode (the graphs stay
    those of a model that never accumulates), else the mode and the buffer's key."""
    mode = state.grad_sync
    if mode == SYNC:
        return {}
    return {"grad_sync": mode, "plan_id": state.plan_id, "fqn": fqn}


def pending_gradient_bytes(model: nn.Module | None = None) -> int:
    """Bytes of accumulated, not yet reduced gradients (of `model`, or of every model)."""
    plans = [sharded_state(model).plan_id] if model is not None else list(_BUFFERS)
    return sum(t.numel() * t.element_size() for plan in plans for t in _BUFFERS.get(plan, {}).values())


def refuse_pending(model: nn.Module, what: str) -> None:
    """Raise PendingGradientsError if `model` holds accumulated gradients not yet reduced."""
    state = sharded_state(model)
    pending = _BUFFERS.get(state.plan_id)
    if pending:
        raise PendingGradientsError(
            f"{what}: {len(pending)} parameters of this model hold gradients accumulated under no_sync "
            f"(e.g. {next(iter(pending))!r}) that no synchronised backward has reduced yet; a checkpoint "
            "would drop them. Save after the optimizer step (after the micro-batch that syncs), or call "
            "zpp_compile.clear_gradient_buffers(model) to discard them."
        )


def clear_gradient_buffers(model: nn.Module | None = None) -> None:
    """Drop accumulated gradients (of `model`, or of every model, e.g. between unrelated runs); the
    next synchronised backward then reduces its own gradient only."""
    if model is None:
        _BUFFERS.clear()
        for state in list(_STATES.values()):
            state.grad_sync = ACCUMULATE if state.grad_sync == ACCUMULATE else SYNC
        return
    state = sharded_state(model)
    _BUFFERS.pop(state.plan_id, None)
    if state.grad_sync == FLUSH:
        state.grad_sync = SYNC


register_reset(clear_gradient_buffers)


@torch.library.custom_op("zpp::accumulate_grad", mutates_args=())
def accumulate_grad(grad: Tensor, plan_id: int, fqn: str) -> None:
    """Add a full gradient into the parameter's accumulation buffer (created on first use)."""
    buffers = _BUFFERS.setdefault(plan_id, {})
    held = buffers.get(fqn)
    if held is None or held.shape != grad.shape or held.dtype != grad.dtype:
        buffers[fqn] = grad.detach().clone(memory_format=torch.contiguous_format)
    else:
        held.add_(grad)


@accumulate_grad.register_fake
def _(grad: Tensor, plan_id: int, fqn: str) -> None:
    return None


@torch.library.custom_op("zpp::flush_grad", mutates_args=())
def flush_grad(grad: Tensor, plan_id: int, fqn: str) -> Tensor:
    """The gradient plus the parameter's accumulated buffer, which is freed (a copy of the gradient
    when nothing is pending). The last buffer of a model to go puts it back in sync mode."""
    buffers = _BUFFERS.get(plan_id, {})
    held = buffers.pop(fqn, None)
    if not buffers:
        _BUFFERS.pop(plan_id, None)
        state = _STATES.get(plan_id)
        if state is not None and state.grad_sync == FLUSH:
            state.grad_sync = SYNC
    if held is None or held.shape != grad.shape:
        return grad.clone(memory_format=torch.contiguous_format)
    return torch.add(grad, held.to(grad.dtype)).contiguous()


@flush_grad.register_fake
def _(grad: Tensor, plan_id: int, fqn: str) -> Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# Side effects on state outside the graph: neither FX's dead-code elimination, the partitioner nor
# Inductor may drop them (accumulate_grad's result is unused by construction).
torch.fx.node.has_side_effect(torch.ops.zpp.accumulate_grad.default)
torch.fx.node.has_side_effect(torch.ops.zpp.flush_grad.default)


def backward_of(grad: Tensor, mode: str, plan_id: int, fqn: str) -> Tensor | None:
    """In a gather marker's backward, before its reduction: None (accumulated, nothing to reduce)
    in accumulate mode; the gradient plus the pending buffer in flush mode; else the gradient."""
    if mode == ACCUMULATE:
        torch.ops.zpp.accumulate_grad(grad, plan_id, fqn)
        return None
    if mode == FLUSH:
        return torch.ops.zpp.flush_grad(grad, plan_id, fqn)
    return grad
