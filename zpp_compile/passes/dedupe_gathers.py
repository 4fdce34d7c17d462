"""dedupe_gathers: one gather per parameter per graph.

Before (Dynamo graph; a tied weight read by two modules, or a weight read twice):
    w_a = zpp.gather_param(p.to_local(), 35, [7, 5], 10, 4, '0')      ... used by linear_1
    w_b = zpp.gather_param(p.to_local(), 35, [7, 5], 10, 4, '0')      ... used by linear_2
After:
    w_a = zpp.gather_param(p.to_local(), 35, [7, 5], 10, 4, '0')      ... used by linear_1 and linear_2

Dynamo's graph calls the op packets (torch.ops.zpp.gather_param), AOT's the overloads
(.default); both are matched. Keyword arguments (mixed precision's dtype=, reduce_dtype=) are
part of the key: only gathers of one shard into one dtype merge. Frozen weights stored quantized (zpp.gather_quantized_param) are deduplicated the same way.
Only gathers in the same grad-mode / autocast region are merged: a gather traced under no_grad
carries no autograd edge, so it must not stand in for a gather whose gradient is needed.
Runs before AOTAutograd, so the backward also gets one gradient reduce-scatter for the tied
weight (autograd sums the two uses first) instead of two.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from .context import PassContext
from .graph_utils import GATHER_MARKERS, finish, graph_input_of, replace_node

log = logging.getLogger(__name__)


def dedupe_gathers(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    markers = set(GATHER_MARKERS) | {m.overloadpacket for m in GATHER_MARKERS}
    first_gather: dict[tuple, fx.Node] = {}
    removed, region = 0, 0
    for node in list(gm.graph.nodes):
        if _changes_mode(node):
            region += 1  # a gather under no_grad / autocast must not stand in for one outside it
        elif node.op == "call_function" and node.target in markers:
            key = (region, *_gather_key(node))
            if key in first_gather:
                replace_node(node, first_gather[key])
                removed += 1
            else:
                first_gather[key] = node
    if not removed:
        log.debug("dedupe_gathers: %s gathers no parameter twice; graph unchanged", ctx.label)
        return gm
    return finish(gm)


def _changes_mode(node: fx.Node) -> bool:
    """Dynamo's grad-mode and autocast switches (torch._C._set_grad_enabled, autocast enter/exit)."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    return name in ("_set_grad_enabled", "_enter_autocast", "_exit_autocast")


def _gather_key(node: fx.Node) -> tuple:
    source, *rest = node.args
    args = (tuple(a) if isinstance(a, list) else a for a in rest)
    # Each read of a DTensor parameter calls its own to_local(): key on the graph input it reads.
    return (node.target, graph_input_of(source), *args, *sorted(node.kwargs.items(), key=lambda kv: kv[0]))
