"""lower_reduce: rewrite each gradient-reduce marker into a functional reduce-scatter, averaged.

Before:  g_shard = zpp.reduce_grad(grad, numel, group_size, group_name)
After:   flat = aten.view(grad, [-1])                    # aten.clone first if grad is not contiguous
         flat = aten.constant_pad_nd(flat, [0, pad])     # only when numel does not divide
         r = _c10d_functional.reduce_scatter_tensor(flat, "sum", group_size, group_name)
         r = _c10d_functional.wait_tensor(r)
         g_shard = aten.div(r, group_size)                # average over the world exactly once

Sum-then-divide rather than reduce_op "avg": gloo has no avg, and Inductor fuses the division.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..ops import padded_numel
from .context import PassContext
from .graph_utils import aten, c10d, calls, finish, insert_call, replace_node

log = logging.getLogger(__name__)


def lower_reduce(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    reduces = list(calls(gm.graph, torch.ops.zpp.reduce_grad.default))
    if not reduces:
        log.debug("lower_reduce: %s has no reduce_grad marker; graph unchanged", ctx.label)
        return gm
    for node in reduces:
        grad, numel, group_size, group_name = node.args
        with gm.graph.inserting_before(node):
            flat = flatten_padded(gm.graph, grad, padded_numel(numel, group_size))
            reduced = insert_call(gm.graph, c10d.reduce_scatter_tensor.default, flat, "sum", group_size, group_name)
            reduced = insert_call(gm.graph, c10d.wait_tensor.default, reduced)
            averaged = insert_call(gm.graph, aten.div.Tensor, reduced, group_size)
        replace_node(node, averaged)
    return finish(gm)


def flatten_padded(graph: fx.Graph, tensor: fx.Node, target_numel: int) -> fx.Node:
    """`tensor` as a contiguous 1-D tensor (copied only if it is strided), zero-padded to target_numel."""
    if not tensor.meta["val"].is_contiguous():
        tensor = insert_call(graph, aten.clone.default, tensor, memory_format=torch.contiguous_format)
    flat = insert_call(graph, aten.view.default, tensor, [-1])
    pad = target_numel - flat.meta["val"].numel()
    if pad:
        flat = insert_call(graph, aten.constant_pad_nd.default, flat, [0, pad])
    return flat
