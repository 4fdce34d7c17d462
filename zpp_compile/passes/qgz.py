"""qgz: int4 hierarchical all-to-all gradient reduce-scatter (ZeRO++ qgZ), bucketed.

Runs on the backward graph before lower_reduce (which then has nothing left to lower).
Before:  g_i = zpp.reduce_grad(grad_i, numel_i, S_i, W, world)     for each parameter i
After:   one plan per bucket of consecutive markers (Config.reduce_bucket_bytes), traced from
         qgz_reduce_scatter and placed where the bucket's last marker was. L ranks per node,
         N nodes, W = N * L; S_i = shard numel of parameter i, C_i = S_i rounded up to a block:
         values = cat_i(pad(grad_i.flat, W*S_i).view(N, L, S_i) padded to C_i)   [N, L, C]
         send = quantize_swizzled(values)                [L, N, P]: row l goes to local rank l
         recv = all_to_all(send, node group)             every local rank's version of my chunks
         part = dequantize_reduce_requantize(recv)       [N, P]: node sums, int4 again (one kernel)
         recv2 = all_to_all(part, cross-node group)      rank l of node n gets its chunk from every node
         total = dequantize_reduce(recv2)                [C] fp32 world sums
         g_i = (total[offset_i : offset_i + S_i] / W).to(grad_i.dtype)
With one node the second stage disappears (the node sum is the world sum, decoded by
dequantize_reduce); with one rank per node the first does (the own gradient is quantized once,
for the cross-node stage). Chunks are whole blocks, so no block mixes two parameters. Inter-node
traffic is int4: C/2 bytes + one fp32 scale per block, per peer node, against 4*S for fp32. The
average is taken once, at the end, in fp32 (bf16/fp16 gradients are read as what they are).
The three kernels come from codegen.registry for the gradients' device (Triton on CUDA).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch import Tensor

from .. import error_feedback  # noqa: F401  (registers zpp::ef_load / zpp::ef_store)
from ..codegen.quantize import ceil_div
from ..codegen.registry import QuantKernels, quant_kernels
from ..error_feedback import new_slot
from ..topology import Topology
from .context import PassContext
from .hierarchical_reduce import (
    all_to_all,
    averaged_shards,
    bucket_layout,
    node_rank_chunks,
    rewrite_reduction_buckets,
)

log = logging.getLogger(__name__)


def qgz(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.quantize_gradients:
        log.debug("qgz: %s: Config.quantize_gradients is off; graph unchanged", ctx.label)
        return gm

    def reduce_bucket(bucket: list[fx.Node]) -> Callable[..., list[Tensor]]:
        return functools.partial(
            qgz_reduce_scatter,
            **bucket_layout(bucket, ctx),
            block=ctx.config.gradient_block_size,
            kernels=quant_kernels(bucket[0].args[0].meta["val"].device),
            error_slots=_error_slots(bucket, ctx) if ctx.config.qgz_error_feedback else None,
            error_beta=ctx.config.qgz_error_beta,
        )

    return rewrite_reduction_buckets(gm, ctx, reduce_bucket, "qgz")


def _error_slots(bucket: list[fx.Node], ctx: PassContext) -> tuple[int, int]:
    """The bucket's two error-feedback slots, keyed by the graph's parameters and the bucket's
    place in it (graphs name no parameters: one graph may serve several modules), so that a
    recompiled graph and a resumed run find the errors of the same gradients (error_feedback.py)."""
    names = ctx.parameter_names
    graph_key = f"{names[0]}..{names[-1]}({len(names)})" if names else ctx.label
    bucket_key = f"{graph_key}/{bucket[0].name}+{len(bucket)}"
    return tuple(new_slot(ctx.plan_id, f"{bucket_key}/stage{stage}") for stage in (1, 2))


def qgz_reduce_scatter(
    *grads: Tensor,
    numels: list[int],
    shards: list[int],
    topology: Topology,
    block: int,
    kernels: Optional[QuantKernels] = None,
    error_slots: Optional[tuple[int, int]] = None,
    error_beta: float = 0.0,
) -> list[Tensor]:
    """This rank's shard of the world-average of each of `grads`, moved as int4 in (up to) two
    all-to-alls for the whole bucket (see above).

    With `error_slots` (Config.qgz_error_feedback) each quantization adds back the error this
    rank made at the same point last step and stores its new error, blended with the old one by
    `error_beta` (Config.qgz_error_beta; see error_feedback.py).
    """
    kernels = kernels or quant_kernels(grads[0].device)
    world, local, nodes = topology.world_size, topology.ranks_per_node, topology.num_nodes
    chunks = [ceil_div(shard, block) * block for shard in shards]
    values = torch.cat(
        [node_rank_chunks(g.float(), n, s, c, nodes, local) for g, n, s, c in zip(grads, numels, shards, chunks)], -1
    )
    chunk = values.shape[-1]
    slots = error_slots or (None, None)
    stores = _ErrorStores(error_beta)
    if local == 1 and nodes == 1:
        total = values.view(chunk)
    elif nodes == 1:  # one node: the in-node stage gives the world sums
        received = all_to_all(
            _quantize_swizzled(values, block, kernels, slots[0], stores), local, topology.node_group_name
        )
        total = kernels.int4_dequantize_reduce(received.view(local, 1, -1), chunk, block).view(chunk)
    else:
        if local == 1:  # nothing to sum inside the node: no first int4 round trip
            payload = _quantize_swizzled(values, block, kernels, slots[1], stores)
        else:
            payload = _quantize_swizzled(values, block, kernels, slots[0], stores)  # [L, N, P]
            received = all_to_all(payload, local, topology.node_group_name).view(local, nodes, -1)
            residual = _load_error(received.new_empty(nodes, chunk, dtype=torch.float32), slots[1])
            payload, error = kernels.int4_dequantize_reduce_requantize(received, chunk, block, residual)
            stores.add(error, slots[1])
        received = all_to_all(payload, nodes, topology.cross_node_group_name).view(nodes, 1, -1)
        total = kernels.int4_dequantize_reduce(received, chunk, block).view(chunk)
    out = averaged_shards(total, chunks, shards, grads, world)
    out[0] = sum(stores.zeros, out[0])
    return out


@dataclasses.dataclass
class _ErrorStores:
    """One reduction's error-feedback stores, each blending by `beta`; `zeros` are their 0-dim
    results, added to the output so that no store is dead code."""

    beta: float
    zeros: list[Tensor] = dataclasses.field(default_factory=list)

    def add(self, error: Optional[Tensor], slot: Optional[int]) -> None:
        if slot is not None:
            self.zeros.append(torch.ops.zpp.ef_store(error, slot, self.beta))


def _quantize_swizzled(
    values: Tensor, block: int, kernels: QuantKernels, slot: Optional[int], stores: _ErrorStores
) -> Tensor:
    residual = _load_error(values.transpose(0, 1), slot)
    payload, error = kernels.int4_quantize_swizzled(values, block, residual)
    stores.add(error, slot)
    return payload


def _load_error(like: Tensor, slot: Optional[int]) -> Optional[Tensor]:
    return None if slot is None else torch.ops.zpp.ef_load(like, slot)
