"""qgz: int4 hierarchical all-to-all gradient reduce-scatter (ZeRO++ qgZ).

Runs on the backward graph before lower_reduce (which then has nothing left to lower).
Before:  g = zpp.reduce_grad(grad, numel, W, world)            -> this rank's averaged shard
After:   (traced from qgz_reduce_scatter; L ranks per node, N nodes, W = N * L, S = shard numel)
         shards = pad(grad.flat, W*S).view(N, L, S)             shard of rank n*L + l at [n, l]
         send = int4(shards.transpose(0, 1))                    [L, N] chunks: chunk l goes to local rank l
         recv = all_to_all(send, node group)                    every local rank's version of my chunks
         part = sum(dequant(recv), over local ranks)            [N, S]: node sums of the shards of n*L + l
         recv2 = all_to_all(int4(part), cross-node group)       rank l of node n gets its shard from every node
         g = sum(dequant(recv2), over nodes) / W                fp32, then the gradient's dtype
With one node the second stage disappears (part is already the world sum); with one rank per
node the first does (part is this rank's own gradient, not quantized twice). Inter-node traffic
is int4: S/2 bytes + one fp32 scale per block, per peer node, against 4*S for an fp32
reduce-scatter. The average is taken once, at the end, in fp32 (bf16/fp16 gradients are read as
what they are, not reinterpreted).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from .. import error_feedback  # noqa: F401  (registers zpp::ef_load / zpp::ef_store)
from ..codegen.int4 import dequantize_int4_chunks, quantize_int4_chunks
from ..error_feedback import new_slot
from ..ops import padded_numel
from ..topology import Topology
from .context import PassContext
from .graph_utils import inline_traced, rewrite_calls

log = logging.getLogger(__name__)


def qgz(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.quantize_gradients:
        log.debug("qgz: %s: Config.quantize_gradients is off; graph unchanged", ctx.label)
        return gm
    rewrite = functools.partial(_quantized_reduce, ctx=ctx)
    return rewrite_calls(gm, torch.ops.zpp.reduce_grad.default, rewrite, "qgz", ctx.label)


def _quantized_reduce(graph: fx.Graph, marker: fx.Node, *, ctx: PassContext) -> fx.Node:
    grad, numel, group_size, _ = marker.args
    if group_size != ctx.topology.world_size:
        raise NotImplementedError(f"qgz: {marker.name} reduces over {group_size} ranks; qgZ reduces over the world.")
    slots = (new_slot(), new_slot()) if ctx.config.qgz_error_feedback else None
    fn = functools.partial(
        qgz_reduce_scatter,
        numel=numel, topology=ctx.topology, block=ctx.config.gradient_block_size, error_slots=slots,
    )  # fmt: skip
    return inline_traced(graph, fn, [grad], ctx.decompositions)


def qgz_reduce_scatter(
    grad: Tensor, numel: int, topology: Topology, block: int, error_slots: Optional[tuple[int, int]] = None
) -> Tensor:
    """This rank's shard of the world-average of `grad`, moved as int4 in two all-to-alls (see above).

    With `error_slots` (Config.qgz_error_feedback) each quantization adds back the error this
    rank made at the same point last step and stores its new error (see error_feedback.py).
    """
    world, local, nodes = topology.world_size, topology.ranks_per_node, topology.num_nodes
    shard = padded_numel(numel, world) // world
    chunk = -(-shard // block) * block
    flat = F.pad(grad.reshape(-1).float(), (0, world * shard - numel))
    shards = F.pad(flat.view(nodes, local, shard), (0, chunk - shard))
    slots = error_slots or (None, None)
    stores: list[Tensor] = []  # error-feedback stores: 0-dim zeros that keep them live
    if local == 1:  # one rank per node: nothing to sum inside the node, no first int4 round trip
        partial = shards.view(nodes, chunk)
    else:
        # Swizzle: local rank l receives, for every node n, the shard that rank n*L + l will own.
        payload = _quantize(shards.transpose(0, 1), block, chunk, slots[0], stores)  # [L, N, P]
        received = _all_to_all(payload, local, topology.node_group_name).view(local, nodes, -1)
        partial = dequantize_int4_chunks(received, chunk, block).sum(dim=0)  # [N, chunk]: node sums
    if nodes > 1:
        payload = _quantize(partial, block, chunk, slots[1], stores)  # [N, P]: for the inter-node stage
        received = _all_to_all(payload, nodes, topology.cross_node_group_name).view(nodes, -1)
        partial = dequantize_int4_chunks(received, chunk, block)  # [N, chunk]: one per source node
    total = partial.sum(dim=0)
    return sum(stores, total[:shard] / world).to(grad.dtype)


def _quantize(values: Tensor, block: int, chunk: int, slot: Optional[int], stores: list[Tensor]) -> Tensor:
    """int4 payloads of `values`. With an error-feedback slot, last step's error is added first and
    the new one stored; the store's 0-dim zero result is appended to `stores`."""
    if slot is None:
        return quantize_int4_chunks(values, block)
    values = values + torch.ops.zpp.ef_load(values, slot)
    payload = quantize_int4_chunks(values, block)
    stores.append(torch.ops.zpp.ef_store(values - dequantize_int4_chunks(payload, chunk, block), slot))
    return payload


def _all_to_all(payload: Tensor, group_size: int, group_name: str) -> Tensor:
    c10d = torch.ops._c10d_functional
    flat = payload.reshape(-1)
    splits = [flat.numel() // group_size] * group_size
    return c10d.wait_tensor(c10d.all_to_all_single(flat, splits, splits, group_name))
