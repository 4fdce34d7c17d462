"""lower_replicated: parameters every rank holds whole (0-d parameters, DTensor Replicate).

Forward / inference, and backward (a recomputed read):
Before:  w = zpp.replicated_param(local, group_size, group_name[, dtype=d])
After:   w = prims.convert_element_type(local, d)      or aten.clone(local) without mixed precision
Backward:
Before:  g = zpp.all_reduce_grad(grad, group_size, group_name)
After:   r = _c10d_functional.all_reduce(grad, "sum", group_name)
         r = _c10d_functional.wait_tensor(r)
         g = aten.div(r, group_size)                       # average over the world exactly once

Nothing to gather, but the gradient is averaged like every other, so the replicas stay equal.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext
from .graph_utils import aten, c10d, insert_call, rewrite_calls


def lower_replicated(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    gm = rewrite_calls(gm, torch.ops.zpp.replicated_param.default, _local_copy, "lower_replicated", ctx.label)
    return rewrite_calls(gm, torch.ops.zpp.all_reduce_grad.default, _all_reduce_mean, "lower_replicated", ctx.label)


def _local_copy(graph: fx.Graph, marker: fx.Node) -> fx.Node:
    local = marker.args[0]
    dtype = marker.kwargs.get("dtype")
    if dtype is not None and dtype != local.meta["val"].dtype:
        copy = insert_call(graph, torch.ops.prims.convert_element_type.default, local, dtype)
    else:
        copy = insert_call(graph, aten.clone.default, local)
    copy.meta.update({k: v for k, v in marker.meta.items() if k != "val"})
    return copy


def _all_reduce_mean(graph: fx.Graph, marker: fx.Node) -> fx.Node:
    grad, group_size, group_name = marker.args
    if not grad.meta["val"].is_contiguous():
        grad = insert_call(graph, aten.clone.default, grad, memory_format=torch.contiguous_format)
    reduced = insert_call(graph, c10d.all_reduce.default, grad, "sum", group_name)
    reduced = insert_call(graph, c10d.wait_tensor.default, reduced)
    return insert_call(graph, aten.div.Tensor, reduced, group_size)
