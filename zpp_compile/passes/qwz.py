"""qwz: quantized weight all-gather in the forward (ZeRO++ qwZ).

Runs on the partitioned forward (and inference) graph, before lower_gather; backward gathers are
left to lower_gather and stay full precision.
Before:  w = zpp.gather_param(shard, numel, shape, group_size, group_name)
After:   (traced from codegen.quantize.quantized_all_gather)
         absmax/scale/round/clamp per block -> q int8; scales bit-cast to int8; cat -> payload
         g = _c10d_functional.all_gather_into_tensor(payload, group_size, group_name); wait_tensor
         split per rank -> q * scale -> slice/view -> w (in the shard's dtype)
Inductor fuses the quantize chain into one kernel writing the payload buffer, and the dequantize
chain into the consumer's input.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx

from ..codegen.quantize import quantized_all_gather
from .context import PassContext
from .graph_utils import calls, finish, inline_traced, replace_node

log = logging.getLogger(__name__)


def qwz(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.quantize_weights:
        log.debug("qwz: %s: Config.quantize_weights is off; graph unchanged", ctx.label)
        return gm
    markers = list(calls(gm.graph, torch.ops.zpp.gather_param.default))
    for marker in markers:
        shard, numel, shape, group_size, group_name = marker.args
        fn = functools.partial(
            quantized_all_gather,
            numel=numel,
            shape=list(shape),
            group_size=group_size,
            group_name=group_name,
            block=ctx.config.weight_block_size,
        )
        with gm.graph.inserting_before(marker):
            weight = inline_traced(gm.graph, fn, [shard], ctx.decompositions)
        replace_node(marker, weight)
    return finish(gm) if markers else gm
