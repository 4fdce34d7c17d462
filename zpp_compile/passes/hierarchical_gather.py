"""hierarchical_gather: each all-gather over the world becomes one across nodes, then one in the
node (Config.hierarchical_gather).

Runs on the lowered forward and backward graphs after bucket_collectives (so it splits the
buckets that travel) and before schedule_overlap (which then places both stages). L ranks per
node, N nodes, W = N * L; x is this rank's [S, ...] part (a bucket, or one parameter's shard):
Before:  w = wait_tensor(all_gather_into_tensor(x, W, world))        (or the _out form, out=buffer)
After:   a = wait_tensor(all_gather_into_tensor(x, N, cross-node))   [N*S]: local rank l's parts from every node
         b = wait_tensor(all_gather_into_tensor(a, L, node))         [L*N*S]: at [l][n], the part of rank n*L + l
         w = cat(b's W parts in world order: part n*L + l is b[l*N + n])          world order, as before
Every use of w is unchanged (the int8 payloads qwZ dequantizes, hpZ's secondary slice).

Why: a ring all-gather over the world carries W-1 parts across each node boundary it crosses
(gloo's: 3 parts each way on 2 nodes x 2), the logical model W-L per node; what the other node
needs of this node's ranks is L parts, which the cross-node stage sends, each rank its own part to
its counterpart on every other node. The in-node stage then moves N*S per rank over the fast link,
and the reorder costs one copy of the gathered bucket.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from ..topology import Topology
from .context import PassContext
from .graph_utils import aten, c10d, calls, finish, insert_call, is_call, tag_collectives

log = logging.getLogger(__name__)

_GATHERS = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)


def hierarchical_gather(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    topology = ctx.topology
    if not ctx.config.hierarchical_gather:
        log.debug("hierarchical_gather: %s: Config.hierarchical_gather is off; graph unchanged", ctx.label)
        return gm
    if topology.num_nodes == 1 or topology.ranks_per_node == 1:
        log.debug("hierarchical_gather: %s: one stage would be the world's gather; graph unchanged", ctx.label)
        return gm
    gathers = [node for node in calls(gm.graph, *_GATHERS) if _over_the_world(node, topology)]
    for start in gathers:
        _split(gm.graph, start, topology)
    log.debug("hierarchical_gather: %s: %d world gathers in two stages", ctx.label, len(gathers))
    return finish(gm) if gathers else gm


def _over_the_world(start: fx.Node, topology: Topology) -> bool:
    """A gather over the world group whose one user is its wait (as lowered and bucketed)."""
    _, group_size, group_name = start.args[:3]
    waited = len(start.users) == 1 and is_call(next(iter(start.users)), c10d.wait_tensor.default)
    return waited and group_size == topology.world_size and group_name == topology.world_group_name


def _split(graph: fx.Graph, start: fx.Node, topology: Topology) -> None:
    (wait,) = start.users
    part = start.args[0]
    nodes, local = topology.num_nodes, topology.ranks_per_node
    shape = list(part.meta["val"].shape)
    custom = start.meta.get("custom")
    before = wait.prev  # the new nodes go between it and the wait
    with graph.inserting_before(wait):
        across = _gathered(graph, part, nodes, topology.cross_node_group_name)
        in_node = _gathered(graph, across, local, topology.node_group_name)
        world_order = _in_world_order(graph, in_node, nodes, local, shape[0])
    tag_collectives(before, wait, custom)  # the block bucketing and regions read
    wait.replace_all_uses_with(world_order)
    out = start.kwargs.get("out")
    graph.erase_node(wait)
    graph.erase_node(start)
    if out is not None and not out.users:
        graph.erase_node(out)


def _in_world_order(graph: fx.Graph, gathered: fx.Node, nodes: int, local: int, rows: int) -> fx.Node:
    """cat of the W parts of `gathered` (at [l][n]) in world order (rank n*L + l): a copy of
    contiguous pieces. Not a permute's copy: Inductor fuses that into the readers (qwZ's
    dequantize), whose indices then carry (i // S) % L terms that cost its CPU code generation
    minutes of sympy on a GPT-2 forward (measured 33 -> 108 s)."""
    at = [local_rank * nodes + node for node in range(nodes) for local_rank in range(local)]  # world order
    parts = [insert_call(graph, aten.slice.Tensor, gathered, 0, i * rows, (i + 1) * rows) for i in at]
    return insert_call(graph, aten.cat.default, parts)


def _gathered(graph: fx.Graph, part: fx.Node, group_size: int, group_name: str) -> fx.Node:
    start = insert_call(graph, c10d.all_gather_into_tensor.default, part, group_size, group_name)
    return insert_call(graph, c10d.wait_tensor.default, start)
