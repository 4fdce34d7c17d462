"""lower_gather: rewrite each parameter-gather marker into a functional all-gather.

Before:  w = zpp.gather_param(shard, numel, shape, group_size, group_name)
After:   g = _c10d_functional.all_gather_into_tensor(shard, group_size, group_name)
         g = _c10d_functional.wait_tensor(g)
         g = aten.slice(g, 0, 0, numel)        # only when the shards carry padding
         w = aten.view(g, shape)

Functional collectives are what Inductor knows how to schedule, bucket and overlap.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .context import PassContext
from .graph_utils import aten, c10d, calls, finish, insert_call, replace_node

log = logging.getLogger(__name__)


def lower_gather(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    gathers = list(calls(gm.graph, torch.ops.zpp.gather_param.default))
    if not gathers:
        log.debug("lower_gather: %s has no gather_param marker; graph unchanged", ctx.label)
        return gm
    for node in gathers:
        shard, numel, shape, group_size, group_name = node.args
        with gm.graph.inserting_before(node):
            full = all_gather_flat(gm.graph, shard, group_size, group_name)
            if tensor_numel(full) != numel:
                full = insert_call(gm.graph, aten.slice.Tensor, full, 0, 0, numel)
            weight = insert_call(gm.graph, aten.view.default, full, list(shape))
        weight.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        replace_node(node, weight)
    return finish(gm)


def all_gather_flat(graph: fx.Graph, shard: fx.Node, group_size: int, group_name: str) -> fx.Node:
    gathered = insert_call(graph, c10d.all_gather_into_tensor.default, shard, group_size, group_name)
    return insert_call(graph, c10d.wait_tensor.default, gathered)


def tensor_numel(node: fx.Node) -> int:
    return node.meta["val"].numel()
