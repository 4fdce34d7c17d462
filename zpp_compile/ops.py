"""Custom ops that mark ZeRO-3 communication in the traced graph.

`zpp::gather_param(shard) -> full weight` and its autograd partner `zpp::reduce_grad(full grad) ->
averaged grad shard`. Eagerly they run plain collectives (the reference path); under tracing their
fake impls give shapes, so Dynamo and AOTAutograd keep them as single, recognisable nodes that the
passes in zpp_compile/passes lower to functional collectives (and, later, quantized plans).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from . import comm
from .codegen.quantize import weight_from_payloads
from .faults import explained_collective_failures
from .topology import current_topology

# torch 2.13 renamed the flat-tensor collectives; keep torch >= 2.11 working.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def padded_numel(numel: int, group_size: int) -> int:
    return -(-numel // group_size) * group_size


@torch.library.custom_op("zpp::gather_param", mutates_args=())
def gather_param(
    shard: Tensor,
    numel: int,
    shape: list[int],
    group_size: int,
    group_name: str,
    *,
    dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """All-gather the flat shards of one parameter and return the full, unpadded weight.

    Mixed precision (Config.param_dtype / reduce_dtype): `dtype` is the dtype the shard is cast to
    before the gather (so the wire and the compute carry it); the gradient is cast to
    `reduce_dtype` before its reduce-scatter. Both None: the shard's own dtype throughout.
    """
    return _eager_all_gather(shard.to(dtype or shard.dtype), group_size, group_name)[:numel].view(shape)


@gather_param.register_fake
def _(shard, numel, shape, group_size, group_name, *, dtype=None, reduce_dtype=None) -> Tensor:
    return shard.new_empty(shape, dtype=dtype or shard.dtype)


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
) -> Tensor:
    """All-gather packed int8 payloads and dequantize them to the full weight.

    Each payload quantizes `shard_numel` elements; a rank may send several back to back (hpZ's
    int8 secondary shard holds world/hpz_size of them). Used for frozen weights stored quantized
    (Config.quantize_frozen_weights) and for hpZ's backward gather under qwZ.
    """
    gathered = _eager_all_gather(payload, group_size, group_name)
    return weight_from_payloads(gathered, numel, shape, shard_numel, block, dtype)


@gather_quantized_param.register_fake
def _(
    payload: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    block: int,
    dtype: torch.dtype,
    group_size: int,
    group_name: str,
) -> Tensor:
    return payload.new_empty(shape, dtype=dtype)


@torch.library.custom_op("zpp::reduce_grad", mutates_args=())
def reduce_grad(grad: Tensor, numel: int, group_size: int, group_name: str) -> Tensor:
    """Reduce-scatter a full gradient and average it over the group: this rank's flat grad shard."""
    flat = pad_flat(grad.reshape(-1), padded_numel(numel, group_size))
    out = flat.new_empty(flat.numel() // group_size)
    with _explained("the eager reduce-scatter of a gradient"):
        _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))
    _record_eager("reduce_scatter", "backward", group_name, flat)
    return out.div_(group_size)


@reduce_grad.register_fake
def _(grad: Tensor, numel: int, group_size: int, group_name: str) -> Tensor:
    return grad.new_empty(padded_numel(numel, group_size) // group_size)


@torch.library.custom_op("zpp::owned_copy", mutates_args=())
def owned_copy(x: Tensor) -> Tensor:
    """A copy in a buffer of its own. Opaque on purpose: Inductor drops a plain clone of a slice
    (remove_noop_ops) and would return a view that keeps the whole gathered weight alive."""
    return x.clone(memory_format=torch.contiguous_format)


@owned_copy.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _eager_all_gather(shard: Tensor, group_size: int, group_name: str) -> Tensor:
    out = shard.new_empty(shard.numel() * group_size)
    with _explained("the eager all-gather of a parameter"):
        _all_gather(out, shard.contiguous(), group=_resolve_process_group(group_name))
    _record_eager("all_gather", "forward", group_name, shard)
    return out


def _explained(where: str):
    return explained_collective_failures(where, current_topology().collective_timeout_s)


def pad_flat(flat: Tensor, target_numel: int) -> Tensor:
    if flat.numel() == target_numel:
        return flat.contiguous()
    return torch.nn.functional.pad(flat, (0, target_numel - flat.numel()))


def _setup_gather_context(ctx, inputs, keyword_only_inputs, output) -> None:
    _, ctx.numel, _, ctx.group_size, ctx.group_name = inputs
    ctx.reduce_dtype = keyword_only_inputs.get("reduce_dtype")


def _gather_backward(ctx, grad: Tensor):
    # A gradient returned in another dtype than the shard's is cast to it by autograd: after the
    # reduce-scatter, so the reduction itself runs in reduce_dtype.
    grad = grad.to(ctx.reduce_dtype or grad.dtype).contiguous()
    grad_shard = torch.ops.zpp.reduce_grad(grad, ctx.numel, ctx.group_size, ctx.group_name)
    return grad_shard, None, None, None, None


gather_param.register_autograd(_gather_backward, setup_context=_setup_gather_context)


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
