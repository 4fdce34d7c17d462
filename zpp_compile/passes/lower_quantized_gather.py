"""lower_quantized_gather: gathers of frozen weights stored as int8 payloads (quantize_frozen_weights).

Runs on the forward and the backward graph (a frozen weight is re-gathered in backward when the
input's gradient needs it); the payload was quantized once, at shard() time, so no quantize step.
Before:  w = zpp.gather_quantized_param(payload, numel, shape, shard_numel, block, dtype, group_size, group)
After:   gathered = wait_tensor(all_gather_into_tensor(payload))        one int8 collective
         w = dequantize_packed(gathered)[:numel].view(shape)             kernels from codegen.registry
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .context import PassContext
from .graph_utils import rewrite_calls
from .qwz import inline_int8_gather


def lower_quantized_gather(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    rewrite = functools.partial(_dequantizing_gather, decompositions=ctx.decompositions)
    marker = torch.ops.zpp.gather_quantized_param.default
    return rewrite_calls(gm, marker, rewrite, "lower_quantized_gather", ctx.label)


def _dequantizing_gather(graph: fx.Graph, marker: fx.Node, *, decompositions: dict) -> fx.Node:
    weight, _, _ = inline_int8_gather(graph, marker, marker.args[4], decompositions)
    return weight
