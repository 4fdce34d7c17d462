"""hierarchical_reduce: gradient reduce-scatters as two all-to-alls, in the node then across nodes,
bucketed and lossless (qgZ's route without its int4; Config.hierarchical_reduce).

Runs on the backward graph after qgz and before lower_reduce (which then has nothing left to lower).
Before:  g_i = zpp.reduce_grad(grad_i, numel_i, S_i, W, world)     for each parameter i
After:   one plan per bucket of consecutive markers (Config.reduce_bucket_bytes), traced from
         hierarchical_reduce_scatter and placed where the bucket's last marker was. L ranks per
         node, N nodes, W = N * L; S_i = shard numel of parameter i; gradients sent in their dtype:
         send = cat_i(pad(grad_i.flat, W*S_i).view(N, L, S_i).transpose(0, 1))   [L, N, S]: row l to local rank l
         recv = all_to_all(send, node group)           every local rank's values of my N chunks
         part = recv.sum(0) in fp32                    [N, S]: node sums
         recv2 = all_to_all(part, cross-node group)    rank l of node n gets its chunk from every node
         total = recv2.sum(0) in fp32                  [S]: world sums
         g_i = (total[offset_i : offset_i + S_i] / W).to(grad_i.dtype)
With one node the second stage disappears; with one rank per node the first does.

Why: a node sends the other nodes (N-1)/N of one gradient's bytes, the node sums. A ring
reduce-scatter over the world sends (W-1)/W of them across each node boundary, and gloo's (a ring
all-reduce) twice that: on 2 nodes x 2 ranks, 3x the bytes of this plan (benchmarks/cluster.py reads
them off the link). The sums are in fp32, in another order than a reduce-scatter's: equal to it
within rounding, not bitwise.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ..topology import Topology
from .buckets import blocks_of, bucket_by_bytes
from .context import PassContext
from .graph_utils import c10d, calls, finish, inline_traced, random_nodes, replace_node, stable_topological_sort

log = logging.getLogger(__name__)


def hierarchical_reduce(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.hierarchical_reduce or ctx.config.quantize_gradients:
        reason = "qgz reduced them (int4, hierarchically)" if ctx.config.quantize_gradients else "it is off"
        log.debug("hierarchical_reduce: %s: %s; graph unchanged", ctx.label, reason)
        return gm

    def reduce_bucket(bucket: list[fx.Node]) -> Callable[..., list[Tensor]]:
        return functools.partial(hierarchical_reduce_scatter, **bucket_layout(bucket, ctx))

    return rewrite_reduction_buckets(gm, ctx, reduce_bucket, "hierarchical_reduce")


def bucket_layout(bucket: list[fx.Node], ctx: PassContext) -> dict:
    """What a bucket's reduction needs of its markers and of the graph: each gradient's numel and
    shard numel, and the topology."""
    return {
        "numels": [marker.args[1] for marker in bucket],
        "shards": [marker.args[2] for marker in bucket],
        "topology": ctx.topology,
    }


def rewrite_reduction_buckets(
    gm: fx.GraphModule,
    ctx: PassContext,
    reduce_bucket: Callable[[list[fx.Node]], Callable[..., list[Tensor]]],
    pass_name: str,
) -> fx.GraphModule:
    """Replace each bucket of world-wide `zpp.reduce_grad` markers (Config.reduce_bucket_bytes, in
    the gradients' dtype, cut by block) by the trace of `reduce_bucket(bucket)(*grads)`, placed where
    the bucket's last marker was; the driver of qgz and hierarchical_reduce."""
    markers = list(calls(gm.graph, torch.ops.zpp.reduce_grad.default))
    if not markers:
        log.debug("%s: %s has no gradient reductions; graph unchanged", pass_name, ctx.label)
        return gm
    for marker in markers:
        if marker.args[3] != ctx.topology.world_size:
            raise NotImplementedError(
                f"{pass_name}: {marker.name} reduces over {marker.args[3]} ranks; it reduces over the world."
            )
    draws = random_nodes(gm.graph)
    for bucket in bucket_by_bytes(markers, _gradient_bytes, ctx.config.reduce_bucket_bytes, blocks_of(ctx)):
        with gm.graph.inserting_before(bucket[-1]):
            shards = inline_traced(gm.graph, reduce_bucket(bucket), [m.args[0] for m in bucket], ctx.decompositions)
        log.debug("%s: %s: one bucket of %d gradients", pass_name, ctx.label, len(bucket))
        for marker, shard in zip(bucket, shards):
            replace_node(marker, shard)
    stable_topological_sort(gm.graph, draws)  # a user of an early marker may sit before the bucket's end
    return finish(gm)


def _gradient_bytes(marker: fx.Node) -> int:
    grad = marker.args[0].meta["val"]
    return marker.args[1] * grad.element_size()


def hierarchical_reduce_scatter(
    *grads: Tensor, numels: list[int], shards: list[int], topology: Topology
) -> list[Tensor]:
    """This rank's shard of the world-average of each of `grads`, moved in their (common) dtype in
    (up to) two all-to-alls for the whole bucket (see above)."""
    world, local, nodes = topology.world_size, topology.ranks_per_node, topology.num_nodes
    wire = functools.reduce(torch.promote_types, [g.dtype for g in grads])
    send = torch.cat(
        [node_rank_chunks(g.to(wire), n, s, s, nodes, local).transpose(0, 1) for g, n, s in zip(grads, numels, shards)],
        -1,
    )  # [L, N, S]
    if local > 1:
        part = all_to_all(send, local, topology.node_group_name).view(send.shape).sum(0, dtype=torch.float32)
    else:
        part = send.view(nodes, -1).float()
    if nodes > 1:
        received = all_to_all(part.to(wire), nodes, topology.cross_node_group_name)
        total = received.view(nodes, -1).sum(0, dtype=torch.float32)
    else:
        total = part.view(-1)
    return averaged_shards(total, shards, shards, grads, world)


def averaged_shards(
    total: Tensor, chunks: list[int], shards: list[int], grads: tuple[Tensor, ...], world: int
) -> list[Tensor]:
    """Each gradient's shard of the bucket's world sums `total` (laid out chunk after chunk, a
    shard at the start of each), divided by the world once and cast back to the gradient's dtype."""
    offsets = itertools.accumulate(chunks, initial=0)
    return [(total[o : o + s] / world).to(g.dtype) for g, o, s in zip(grads, offsets, shards)]


def node_rank_chunks(grad: Tensor, numel: int, shard: int, chunk: int, nodes: int, local: int) -> Tensor:
    """[N, L, chunk]: the (padded) shard of rank n*L + l at [n, l], padded to `chunk` elements."""
    flat = F.pad(grad.reshape(-1), (0, nodes * local * shard - numel))
    return F.pad(flat.view(nodes, local, shard), (0, chunk - shard))


def all_to_all(payload: Tensor, group_size: int, group_name: str) -> Tensor:
    """The functional all-to-all of `payload`'s equal rows, flat, waited on."""
    flat = payload.reshape(-1)
    splits = [flat.numel() // group_size] * group_size
    return c10d.wait_tensor(c10d.all_to_all_single(flat, splits, splits, group_name))
