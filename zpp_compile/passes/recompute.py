"""recompute: never save a gathered full weight for backward; re-gather it there instead.

Runs on the joint forward+backward graph, before the partitioner.
Before:  w = zpp.gather_param(shard, ...); wt = aten.t(w); y = aten.mm(x, wt)  ...  mm(grad, wt)
         (the default partitioner saves `wt`, a full-size weight, from forward for backward)
After:   the same graph, with node.meta["recompute"] = MUST_RECOMPUTE on `w` and on every view or
         dtype cast hanging off it, so min_cut_rematerialization_partition puts a second
         gather_param (on the saved *shard*) into the backward graph.

`check_no_gathered_weight_saved` verifies the result after partitioning.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .context import PassContext
from .graph_utils import GATHER_MARKERS, calls, is_view_or_cast


class GatheredWeightSavedError(RuntimeError):
    pass


def tag_gathers_for_recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gathered_weight_nodes(gm.graph):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        # The partitioner keeps MUST_RECOMPUTE nodes together only within one "AC region".
        node.meta.setdefault("ac_graph_id", 0)
    return gm


def gathered_weight_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Every gather output and every view/cast of one: the values that are full-size weights."""
    found: dict[fx.Node, None] = {}
    frontier = list(calls(graph, *GATHER_MARKERS))
    while frontier:
        node = frontier.pop()
        if node in found:
            continue
        found[node] = None
        frontier.extend(user for user in node.users if is_view_or_cast(user))
    return list(found)


def check_no_gathered_weight_saved(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, ctx: PassContext) -> None:
    """Raise if any value the forward saves for backward is a gathered weight (or a view of one).

    The forward's outputs are the graph's own outputs followed by what it saves (the backward's
    inputs other than the tangents). A gathered weight among the former is the model's business:
    a graph break right after a parameter read hands the weight to the eager code and the next
    graph (its gradient comes back through autograd); only the saved ones break the bound.
    """
    weights = set(gathered_weight_nodes(fw_gm.graph))
    fw_outputs = fw_gm.graph.output_node().args[0]
    saved_count = sum(1 for p in bw_gm.graph.nodes if p.op == "placeholder" and not p.name.startswith("tangents"))
    saved_outputs = fw_outputs[len(fw_outputs) - saved_count :] if saved_count else []
    saved = [n for n in saved_outputs if isinstance(n, fx.Node) and n in weights]
    if saved and not ctx.config.save_gathered_weights:
        raise GatheredWeightSavedError(
            f"{ctx.label}: the partitioner saved gathered weights {[n.name for n in saved]} for backward; "
            "this breaks the ZeRO-3 memory bound. Please report it with the dumped graphs (ZPP_DUMP_GRAPHS)."
        )
