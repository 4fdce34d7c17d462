"""Graph passes, one per file, each `(gm, ctx) -> gm`. See README.md here for the invariants.

The pipelines below are the order the backend applies them in; tests apply passes one at a time.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .bucket_collectives import bucket_collectives
from .buckets import compiled_whole_reason, cuts_at_blocks
from .context import PassContext
from .dedupe_gathers import dedupe_gathers
from .fold_scatter_grads import fold_scatter_grads
from .graph_utils import deferred_recompile
from .hierarchical_gather import hierarchical_gather
from .hierarchical_reduce import hierarchical_reduce
from .hpz import hpz
from .localize_constant_scalars import localize_constant_scalars, partition_without_cse
from .lower_gather import lower_gather
from .lower_quantized_gather import lower_quantized_gather
from .lower_reduce import lower_reduce
from .lower_replicated import lower_replicated
from .order_saved_values import order_saved_values
from .qgz import qgz
from .qwz import qwz
from .read_local_inputs import read_local_inputs
from .recompute import check_no_gathered_weight_saved, kept_for_backward, tag_gathers_for_recompute
from .root_large_collectives import root_large_collectives
from .schedule_overlap import schedule_overlap
from .sink_large_results import sink_large_results
from .tag_parameter_inputs import parameter_names_of, tag_parameter_inputs

GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
PartitionPass = Callable[[fx.GraphModule, fx.GraphModule, PassContext], tuple[fx.GraphModule, fx.GraphModule]]

# On the Dynamo graph, before AOTAutograd (changes what the backward computes).
PRE_AUTOGRAD_PASSES: list[GraphPass] = [dedupe_gathers, tag_parameter_inputs]
# On the joint graph, before partitioning (changes what the forward saves).
JOINT_PASSES: list[GraphPass] = [read_local_inputs, tag_gathers_for_recompute, localize_constant_scalars]
# On the forward and backward graphs together, right after partitioning (changes what is saved).
PARTITION_PASSES: list[PartitionPass] = [hpz, order_saved_values]
# On the partitioned graphs, before lowering to Inductor.
# qwz first: it rewrites the forward gathers it quantizes; lower_gather takes whatever is left.
# The scheduling passes come last: they see the collectives that really travel.
# hierarchical_gather between them: it splits the buckets that travel, and the overlap places both stages.
SCHEDULING_PASSES: list[GraphPass] = [bucket_collectives, hierarchical_gather, schedule_overlap]
# root_large_collectives after them: it changes how a collective travels, not where it starts or ends.
FORWARD_PASSES: list[GraphPass] = [
    qwz,
    lower_gather,
    lower_quantized_gather,
    lower_replicated,
    *SCHEDULING_PASSES,
    root_large_collectives,
]
# qgz and hierarchical_reduce before lower_reduce: they rewrite the gradient reductions they take.
BACKWARD_PASSES: list[GraphPass] = [
    lower_gather,
    lower_quantized_gather,
    lower_replicated,
    qgz,
    hierarchical_reduce,
    lower_reduce,
    sink_large_results,  # before scheduling: the overlap places the collectives around its order
    *SCHEDULING_PASSES,
    fold_scatter_grads,  # after scheduling: it writes in place, which their data dependences miss
    root_large_collectives,
]


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[GraphPass]) -> fx.GraphModule:
    """Apply `passes` in order, timing each (stage "<phase>/<pass>") and dumping the graph before
    the first and after each one."""
    ctx.dump(gm, "input")
    with deferred_recompile():
        for graph_pass in passes:
            with ctx.stage_seconds.timed(f"{ctx.phase}/{graph_pass.__name__}"):
                gm = graph_pass(gm, ctx)
            ctx.dump(gm, graph_pass.__name__)
    with ctx.stage_seconds.timed(f"{ctx.phase}/recompile"):
        gm.recompile()
    return gm


def run_partition_passes(
    fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, ctx: PassContext
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Apply PARTITION_PASSES, timing each and dumping both graphs after each (dump stages
    "<pass>_forward/_backward")."""
    with deferred_recompile():
        for partition_pass in PARTITION_PASSES:
            with ctx.stage_seconds.timed(f"{ctx.phase}/{partition_pass.__name__}"):
                fw_gm, bw_gm = partition_pass(fw_gm, bw_gm, ctx)
            ctx.dump(fw_gm, f"{partition_pass.__name__}_forward")
            ctx.dump(bw_gm, f"{partition_pass.__name__}_backward")
    with ctx.stage_seconds.timed(f"{ctx.phase}/recompile"):
        fw_gm.recompile()
        bw_gm.recompile()
    return fw_gm, bw_gm


__all__ = [
    "BACKWARD_PASSES",
    "SCHEDULING_PASSES",
    "bucket_collectives",
    "schedule_overlap",
    "sink_large_results",
    "FORWARD_PASSES",
    "JOINT_PASSES",
    "PRE_AUTOGRAD_PASSES",
    "PARTITION_PASSES",
    "GraphPass",
    "PartitionPass",
    "PassContext",
    "check_no_gathered_weight_saved",
    "parameter_names_of",
    "compiled_whole_reason",
    "cuts_at_blocks",
    "dedupe_gathers",
    "fold_scatter_grads",
    "hierarchical_gather",
    "localize_constant_scalars",
    "partition_without_cse",
    "hierarchical_reduce",
    "hpz",
    "kept_for_backward",
    "lower_gather",
    "lower_quantized_gather",
    "lower_reduce",
    "lower_replicated",
    "order_saved_values",
    "qgz",
    "qwz",
    "read_local_inputs",
    "root_large_collectives",
    "run_partition_passes",
    "run_passes",
    "tag_gathers_for_recompute",
    "tag_parameter_inputs",
]
