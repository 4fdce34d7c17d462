"""Custom ops that mark ZeRO-3 communication in the traced graph.

`zpp::gather_param(local part) -> full weight` and its autograd partner `zpp::reduce_grad(full
grad) -> averaged padded part`; `zpp::replicated_param` / `zpp::all_reduce_grad` for parameters
every rank holds whole; `zpp::gather_quantized_param` for weights stored or kept as int8 payloads.
Eagerly they run collectives (eager_collectives.py; the reference path); under tracing their fake impls give
shapes, so Dynamo and AOTAutograd keep them as single, recognisable nodes that the passes in
zpp_compile/passes lower to functional collectives or to the quantized plans (qwZ, hpZ, qgZ).

Every marker carries the parameter's name (`fqn=`), so the schedule check can say which parameter
two ranks disagree on; the lowerings ignore it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from . import comm, schedule_check
from . import grad_sync as _grad_sync
from .codegen.quantize import weight_from_payloads
from .eager_collectives import all_gather_flat, reduce_scatter_flat
from .rooted_ops import explained_failures_in
from .topology import current_topology


@torch.library.custom_op("zpp::gather_param", mutates_args=())
def gather_param(
    local: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    group_size: int,
    group_name: str,
    *,
    dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    fqn: str = "",
    grad_sync: str = "sync",
    plan_id: int = -1,
) -> Tensor:
    """All-gather one parameter from every rank's part and return the full, unpadded weight.

    `local` is this rank's part (a DTensor's local chunk, any shape); it travels flattened and
    zero-padded to `shard_numel` elements, so every rank sends the same bytes and the gathered
    buffer is the full tensor followed by zeros. Mixed precision (Config.param_dtype /
    reduce_dtype): `dtype` is the dtype the part is cast to before the gather (so the wire and
    the compute carry it); the gradient is cast to `reduce_dtype` before its reduce-scatter.
    Both None: the part's own dtype throughout. `grad_sync` / `plan_id` say what the backward does
    with the gradient (grad_sync.py: "sync" reduces it, "accumulate" keeps it in zpp_compile's
    buffer for `fqn`, "flush" reduces it plus that buffer).
    """
    flat = pad_flat(local.reshape(-1), shard_numel).to(dtype or local.dtype)
    return _eager_all_gather(flat, group_size, group_name, fqn)[:numel].view(shape)


@gather_param.register_fake
def _(
    local, numel, shape, shard_numel, group_size, group_name, *,
    dtype=None, reduce_dtype=None, fqn="", grad_sync="sync", plan_id=-1,
) -> Tensor:  # fmt: skip
    return local.new_empty(shape, dtype=dtype or local.dtype)


@torch.library.custom_op("zpp::replicated_param", mutates_args=())
def replicated_param(
    local: Tensor,
    group_size: int,
    group_name: str,
    *,
    dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    fqn: str = "",
    grad_sync: str = "sync",
    plan_id: int = -1,
) -> Tensor:
    """A parameter every rank holds whole (DTensor Replicate; 0-d parameters): nothing to gather,
    but its gradient is averaged over the group (zpp::all_reduce_grad). Returns a copy in `dtype`."""
    return local.to(dtype or local.dtype, copy=True)


@replicated_param.register_fake
def _(local, group_size, group_name, *, dtype=None, reduce_dtype=None, fqn="", grad_sync="sync", plan_id=-1) -> Tensor:
    return torch.empty_like(local, dtype=dtype or local.dtype)


@torch.library.custom_op("zpp::gather_quantized_param", mutates_args=())
def gather_quantized_param(
    payload: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    block: int,
    dtype: torch.dtype,
    group_size: int,
    group_name: str,
    *,
    fqn: str = "",
) -> Tensor:
    """All-gather packed int8 payloads and dequantize them to the full weight.

    Each payload quantizes `shard_numel` elements; a rank may send several back to back (hpZ's
    int8 secondary shard holds world/hpz_size of them). Used for frozen weights stored quantized
    (Config.quantize_frozen_weights) and for hpZ's backward gather under qwZ.
    """
    gathered = _eager_all_gather(payload, group_size, group_name, fqn)
    return weight_from_payloads(gathered, numel, shape, shard_numel, block, dtype, senders=group_size)


@gather_quantized_param.register_fake
def _(payload, numel, shape, shard_numel, block, dtype, group_size, group_name, *, fqn="") -> Tensor:
    return payload.new_empty(shape, dtype=dtype)


@torch.library.custom_op("zpp::reduce_grad", mutates_args=())
def reduce_grad(
    grad: Tensor, numel: int, shard_numel: int, group_size: int, group_name: str, *, fqn: str = ""
) -> Tensor:
    """Reduce-scatter a full gradient and average it over the group: this rank's padded part,
    flat, `shard_numel` elements (gather_param's backward cuts it to the local chunk)."""
    flat = pad_flat(grad.reshape(-1), shard_numel * group_size)
    out = flat.new_empty(shard_numel)
    with explained_failures_in("the eager reduce-scatter of a gradient", group_name):
        _check_eager("reduce_scatter", group_name, flat, fqn)
        reduce_scatter_flat(out, flat, _resolve_process_group(group_name))
    _record_eager("reduce_scatter", "backward", group_name, flat)
    return out.div_(group_size)


@reduce_grad.register_fake
def _(grad, numel, shard_numel, group_size, group_name, *, fqn="") -> Tensor:
    return grad.new_empty(shard_numel)


@torch.library.custom_op("zpp::all_reduce_grad", mutates_args=())
def all_reduce_grad(grad: Tensor, group_size: int, group_name: str, *, fqn: str = "") -> Tensor:
    """The gradient of a replicated parameter, averaged over the group (every rank gets it whole)."""
    out = grad.contiguous().clone()
    with explained_failures_in("the eager all-reduce of a gradient", group_name):
        _check_eager("all_reduce", group_name, out, fqn)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))
    _record_eager("all_reduce", "backward", group_name, out)
    return out.div_(group_size)


@all_reduce_grad.register_fake
def _(grad, group_size, group_name, *, fqn="") -> Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


@torch.library.custom_op("zpp::owned_slot", mutates_args=())
def owned_slot(flat: Tensor, slots: int, group_name: str) -> Tensor:
    """This rank's slot of `flat` cut into `slots` equal parts (the slot of its rank in the group
    `group_name`), in a buffer of its own. Opaque on purpose: Inductor drops a plain clone of a
    slice (remove_noop_ops) and would return a view that keeps the whole of `flat` alive. The rank
    is read when the op runs, not written into the graph: the graph is then the same on every rank
    of the group, and a host compiles it once (compile_sharing)."""
    _check_slots(flat, slots)
    rank = dist.get_rank(_resolve_process_group(group_name))
    return flat.reshape(slots, -1)[rank].clone(memory_format=torch.contiguous_format)


@owned_slot.register_fake
def _(flat: Tensor, slots: int, group_name: str) -> Tensor:
    _check_slots(flat, slots)
    return flat.new_empty(flat.numel() // slots)


def _check_slots(flat: Tensor, slots: int) -> None:
    if flat.dim() != 1 or flat.numel() % slots:
        raise ValueError(f"zpp::owned_slot: a flat tensor of {flat.numel()} elements does not cut into {slots} slots")


def _eager_all_gather(shard: Tensor, group_size: int, group_name: str, fqn: str) -> Tensor:
    out = shard.new_empty(shard.numel() * group_size)
    with explained_failures_in("the eager all-gather of a parameter", group_name):
        _check_eager("all_gather", group_name, shard, fqn)
        all_gather_flat(out, shard.contiguous(), _resolve_process_group(group_name))
    # In backward: regather.py gathering a weight again instead of having kept it.
    phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    _record_eager("all_gather", phase, group_name, shard)
    return out


def _check_eager(op: str, group_name: str, payload: Tensor, fqn: str) -> None:
    """The schedule check of one eager collective (a no-op outside the checked runs)."""
    entry = schedule_check.ScheduledCollective(
        op, len(comm.group_ranks(group_name)), str(payload.dtype).removeprefix("torch."), payload.numel(), (fqn,)
    )
    schedule_check.maybe_check(schedule_check.Schedule("eager", (entry,)), group_name, payload.device)


def pad_flat(flat: Tensor, target_numel: int) -> Tensor:
    if flat.numel() == target_numel:
        return flat.contiguous()
    return torch.nn.functional.pad(flat, (0, target_numel - flat.numel()))


def _setup_gather_context(ctx, inputs, keyword_only_inputs, output) -> None:
    local, ctx.numel, _, ctx.shard_numel, ctx.group_size, ctx.group_name = inputs
    ctx.local_shape = local.shape
    ctx.reduce_dtype = keyword_only_inputs.get("reduce_dtype")
    ctx.fqn = keyword_only_inputs.get("fqn", "")
    ctx.grad_sync = keyword_only_inputs.get("grad_sync", _grad_sync.SYNC)
    ctx.plan_id = keyword_only_inputs.get("plan_id", -1)


def _gather_backward(ctx, grad: Tensor):
    # A gradient returned in another dtype than the part's is cast to it by autograd: after the
    # reduce-scatter, so the reduction itself runs in reduce_dtype.
    grad = grad.to(ctx.reduce_dtype or grad.dtype).contiguous()
    grad = _grad_sync.backward_of(grad, ctx.grad_sync, ctx.plan_id, ctx.fqn)
    if grad is None:  # accumulated under no_sync: nothing reduced, the shard's gradient untouched
        return None, None, None, None, None, None
    padded = torch.ops.zpp.reduce_grad(grad, ctx.numel, ctx.shard_numel, ctx.group_size, ctx.group_name, fqn=ctx.fqn)
    local_grad = padded[: math.prod(ctx.local_shape)].view(ctx.local_shape)
    return local_grad, None, None, None, None, None


gather_param.register_autograd(_gather_backward, setup_context=_setup_gather_context)


def _setup_replicated_context(ctx, inputs, keyword_only_inputs, output) -> None:
    _, ctx.group_size, ctx.group_name = inputs
    ctx.reduce_dtype = keyword_only_inputs.get("reduce_dtype")
    ctx.fqn = keyword_only_inputs.get("fqn", "")
    ctx.grad_sync = keyword_only_inputs.get("grad_sync", _grad_sync.SYNC)
    ctx.plan_id = keyword_only_inputs.get("plan_id", -1)


def _replicated_backward(ctx, grad: Tensor):
    grad = _grad_sync.backward_of(grad.to(ctx.reduce_dtype or grad.dtype), ctx.grad_sync, ctx.plan_id, ctx.fqn)
    if grad is None:
        return None, None, None
    return torch.ops.zpp.all_reduce_grad(grad, ctx.group_size, ctx.group_name, fqn=ctx.fqn), None, None


replicated_param.register_autograd(_replicated_backward, setup_context=_setup_replicated_context)


def _record_eager(op: comm.CollectiveOp, phase: comm.Phase, group_name: str, payload: Tensor) -> None:
    collective = comm.Collective(
        op=op,
        phase=phase,
        group_name=group_name,
        group_ranks=comm.group_ranks(group_name),
        dtype=payload.dtype,
        input_numel=payload.numel(),
        label="eager",
    )
    comm.comm_counter().record([collective], current_topology())
