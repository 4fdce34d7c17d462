"""qwz: quantized weight all-gather in the forward (ZeRO++ qwZ).

Runs on the partitioned forward (and inference) graph, before lower_gather; backward gathers are
left to lower_gather and stay full precision.
Before:  w = zpp.gather_param(shard, numel, shape, group_size, group_name)
After:   (traced from codegen.quantize.quantized_all_gather)
         absmax / scale / round / clamp per block        -> q int8, scale float32
         all_gather_into_tensor(q) ; all_gather_into_tensor(scale) ; wait_tensor x2
         q * scale per block -> drop each rank's padding -> view(shape) -> w (in the shard's dtype)
Inductor fuses the quantize chain into one kernel writing the int8 send buffer, and the
dequantize chain into one kernel after the gathers.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx

from ..codegen.quantize import quantized_all_gather
from .context import PassContext
from .graph_utils import inline_traced, rewrite_calls

log = logging.getLogger(__name__)


def qwz(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.quantize_weights:
        log.debug("qwz: %s: Config.quantize_weights is off; graph unchanged", ctx.label)
        return gm
    rewrite = functools.partial(_quantized_gather, block=ctx.config.weight_block_size, decompositions=ctx.decompositions)
    return rewrite_calls(gm, torch.ops.zpp.gather_param.default, rewrite, "qwz", ctx.label)


def _quantized_gather(graph: fx.Graph, marker: fx.Node, *, block: int, decompositions: dict) -> fx.Node:
    shard, numel, shape, group_size, group_name = marker.args
    fn = functools.partial(
        quantized_all_gather, numel=numel, shape=list(shape), group_size=group_size, group_name=group_name, block=block
    )
    return inline_traced(graph, fn, [shard], decompositions)
