"""lower_reduce: rewrite each gradient-reduce marker into a functional reduce-scatter, averaged.

Before:  g_shard = zpp.reduce_grad(grad, numel, shard_numel, group_size, group_name)
After:   flat = aten.view(grad, [-1])                    # aten.clone first if grad is not contiguous
         flat = aten.constant_pad_nd(flat, [0, pad])     # to shard_numel * group_size, if short
         r = _c10d_functional.reduce_scatter_tensor(flat, "sum", group_size, group_name)
         r = _c10d_functional.wait_tensor(r)
         g_shard = aten.div(r, group_size)                # average over the world exactly once

Sum-then-divide rather than reduce_op "avg": gloo has no avg, and Inductor fuses the division.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext
from .graph_utils import aten, c10d, flatten_padded, insert_call, rewrite_calls


def lower_reduce(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return rewrite_calls(gm, torch.ops.zpp.reduce_grad.default, _reduce_scatter_mean, "lower_reduce", ctx.label)


def _reduce_scatter_mean(graph: fx.Graph, marker: fx.Node) -> fx.Node:
    grad, numel, shard_numel, group_size, group_name = marker.args
    flat = flatten_padded(graph, grad, shard_numel * group_size)
    reduced = insert_call(graph, c10d.reduce_scatter_tensor.default, flat, "sum", group_size, group_name)
    reduced = insert_call(graph, c10d.wait_tensor.default, reduced)
    return insert_call(graph, aten.div.Tensor, reduced, group_size)
