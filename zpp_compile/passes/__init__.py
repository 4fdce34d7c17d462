"""Graph passes, one per file, each `(gm, ctx) -> gm`. See README.md here for the invariants.

The pipelines below are the order the backend applies them in; tests apply passes one at a time.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .context import PassContext
from .dedupe_gathers import dedupe_gathers
from .lower_gather import lower_gather
from .lower_reduce import lower_reduce
from .qwz import qwz
from .recompute import check_no_gathered_weight_saved, tag_gathers_for_recompute

GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# On the Dynamo graph, before AOTAutograd (changes what the backward computes).
PRE_AUTOGRAD_PASSES: list[GraphPass] = [dedupe_gathers]
# On the joint graph, before partitioning (changes what the forward saves).
JOINT_PASSES: list[GraphPass] = [tag_gathers_for_recompute]
# On the partitioned graphs, before lowering to Inductor.
# qwz first: it rewrites the forward gathers it quantizes; lower_gather takes whatever is left.
FORWARD_PASSES: list[GraphPass] = [qwz, lower_gather]
BACKWARD_PASSES: list[GraphPass] = [lower_gather, lower_reduce]


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[GraphPass]) -> fx.GraphModule:
    """Apply `passes` in order, dumping the graph before the first and after each one."""
    ctx.dump(gm, "input")
    for graph_pass in passes:
        gm = graph_pass(gm, ctx)
        ctx.dump(gm, graph_pass.__name__)
    return gm


__all__ = [
    "BACKWARD_PASSES",
    "FORWARD_PASSES",
    "JOINT_PASSES",
    "PRE_AUTOGRAD_PASSES",
    "GraphPass",
    "PassContext",
    "check_no_gathered_weight_saved",
    "dedupe_gathers",
    "lower_gather",
    "lower_reduce",
    "qwz",
    "run_passes",
    "tag_gathers_for_recompute",
]
