"""dedupe_gathers: one gather per parameter per graph.

Before (Dynamo graph; a tied weight read by two modules, or a weight read twice):
    w_a = zpp.gather_param(shard, 35, [7, 5], 4, '0')      ... used by linear_1
    w_b = zpp.gather_param(shard, 35, [7, 5], 4, '0')      ... used by linear_2
After:
    w_a = zpp.gather_param(shard, 35, [7, 5], 4, '0')      ... used by linear_1 and linear_2

Dynamo's graph calls the op packets (torch.ops.zpp.gather_param), AOT's the overloads
(.default); both are matched. Frozen weights stored quantized (zpp.gather_quantized_param) are deduplicated the same way.
Runs before AOTAutograd, so the backward also gets one gradient reduce-scatter for the tied
weight (autograd sums the two uses first) instead of two.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from .context import PassContext
from .graph_utils import GATHER_MARKERS, calls, finish, replace_node

log = logging.getLogger(__name__)


def dedupe_gathers(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    first_gather: dict[tuple, fx.Node] = {}
    removed = 0
    for node in calls(gm.graph, *GATHER_MARKERS, *(m.overloadpacket for m in GATHER_MARKERS)):
        key = _gather_key(node)
        if key in first_gather:
            replace_node(node, first_gather[key])
            removed += 1
        else:
            first_gather[key] = node
    if not removed:
        log.debug("dedupe_gathers: %s gathers no parameter twice; graph unchanged", ctx.label)
        return gm
    return finish(gm)


def _gather_key(node: fx.Node) -> tuple:
    return (node.target, *(tuple(a) if isinstance(a, list) else a for a in node.args))
