"""lower_gather: rewrite each parameter-gather marker into a functional all-gather.

Before:  w = zpp.gather_param(local, numel, shape, shard_numel, group_size, group_name[, dtype=d])
After:   flat = aten.view(local, [-1])                  # aten.clone first if local is strided
         flat = aten.constant_pad_nd(flat, [0, pad])    # only on a rank holding fewer rows
         shard = prims.convert_element_type(flat, d)    # only under mixed precision
         g = _c10d_functional.all_gather_into_tensor(shard, group_size, group_name)
         g = _c10d_functional.wait_tensor(g)
         g = aten.slice(g, 0, 0, numel)        # only when the shards carry padding
         w = aten.view(g, shape)

Functional collectives are what Inductor knows how to schedule, bucket and overlap.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext
from .graph_utils import aten, c10d, flatten_padded, insert_call, rewrite_calls


def lower_gather(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return rewrite_calls(gm, torch.ops.zpp.gather_param.default, _all_gather_weight, "lower_gather", ctx.label)


def _all_gather_weight(graph: fx.Graph, marker: fx.Node) -> fx.Node:
    local, numel, shape, shard_numel, group_size, group_name = marker.args
    shard = cast_for_gather(graph, flatten_padded(graph, local, shard_numel), marker)
    full = all_gather_flat(graph, shard, group_size, group_name)
    if full.meta["val"].numel() != numel:
        full = insert_call(graph, aten.slice.Tensor, full, 0, 0, numel)
    weight = insert_call(graph, aten.view.default, full, list(shape))
    # Keep the marker's tags (e.g. MUST_RECOMPUTE, stack trace) on the node that replaces it.
    weight.meta.update({k: v for k, v in marker.meta.items() if k != "val"})
    return weight


def cast_for_gather(graph: fx.Graph, shard: fx.Node, marker: fx.Node) -> fx.Node:
    """The shard in the gather's dtype (mixed precision: Config.param_dtype), cast before the wire."""
    dtype = marker.kwargs.get("dtype")
    if dtype is None or dtype == shard.meta["val"].dtype:
        return shard
    return insert_call(graph, torch.ops.prims.convert_element_type.default, shard, dtype)


def all_gather_flat(graph: fx.Graph, shard: fx.Node, group_size: int, group_name: str) -> fx.Node:
    gathered = insert_call(graph, c10d.all_gather_into_tensor.default, shard, group_size, group_name)
    return insert_call(graph, c10d.wait_tensor.default, gathered)
