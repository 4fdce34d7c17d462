"""recompute: never save a gathered full weight for backward; re-gather it there instead.

Runs on the joint forward+backward graph, before the partitioner.
Before:  w = zpp.gather_param(shard, ...); wt = aten.t(w); y = aten.mm(x, wt)  ...  mm(grad, wt)
         (the default partitioner saves `wt`, a full-size weight, from forward for backward)
After:   the same graph, with node.meta["recompute"] = MUST_RECOMPUTE on `w` and on every view or
         dtype cast hanging off it, so min_cut_rematerialization_partition puts a second
         gather_param (on the saved *shard*) into the backward graph.

Except the forward's last weights outside any repeated block (Config.keep_last_weights_gathered,
`kept_for_backward`): the backward starts with them, so they are tagged MUST_SAVE instead and
the forward hands them to the backward as they are (node.meta[KEPT_FOR_BACKWARD] marks them).

`check_no_gathered_weight_saved` verifies the result after partitioning.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..layout import block_of_name
from .context import PassContext
from .graph_utils import GATHER_MARKERS, SHARD_GATHERS, backward_nodes, calls, is_view_or_cast
from .tag_parameter_inputs import PARAM_INPUT

# node.meta key: a gathered weight (or view of one) the forward saves for backward on purpose.
KEPT_FOR_BACKWARD = "zpp_kept_for_backward"


class GatheredWeightSavedError(RuntimeError):
    pass


def tag_gathers_for_recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    kept = kept_for_backward(gm.graph, ctx)
    for gather in kept:
        gather.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    kept_weights = set(weight_values(list(kept)))
    for node in kept_weights:
        node.meta[KEPT_FOR_BACKWARD] = True
    for node in gathered_weight_nodes(gm.graph):
        if node in kept_weights:
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        # The partitioner keeps MUST_RECOMPUTE nodes together only within one "AC region".
        node.meta.setdefault("ac_graph_id", 0)
    return gm


def kept_for_backward(graph: fx.Graph, ctx: PassContext) -> set[fx.Node]:
    """The gathers of a joint graph whose weights stay gathered into the backward
    (Config.keep_last_weights_gathered): going back from the forward's last read, the weights
    outside any repeated block (output head, final norm, a tied embedding), up to the first one
    inside a block; in a graph without repeated blocks, the last weight read alone. Only weights
    the backward reads; none that qwZ gathers (its forward weights are approximate: all of them
    unless Config.qwz_parameters names some) or where every gathered weight is saved anyway."""
    config = ctx.config
    every_weight_int8 = config.quantize_weights and config.qwz_parameters is None
    if not config.keep_last_weights_gathered or every_weight_int8 or config.save_gathered_weights:
        return set()
    backward = backward_nodes(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    last_read: dict[fx.Node, int] = {}
    for gather in calls(graph, *SHARD_GATHERS):
        weights = set(weight_values([gather]))
        readers = [user for w in weights for user in w.users if user not in weights]
        if gather not in backward and any(user in backward for user in readers):
            last_read[gather] = max((position[u] for u in readers if u not in backward), default=position[gather])
    name_at = dict(zip(ctx.parameter_positions, ctx.parameter_names))
    has_blocks = any(block_of_name(name) for name in ctx.parameter_names)
    kept: set[fx.Node] = set()
    for gather in sorted(last_read, key=last_read.__getitem__, reverse=True):
        name = name_at.get(gather.meta.get("custom", {}).get(PARAM_INPUT))
        if name is None or block_of_name(name):  # unnamed: never assume it lies outside the blocks
            break
        if not config.quantizes_weight(name):
            kept.add(gather)
        if not has_blocks:
            break
    return kept


def gathered_weight_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Every gather output and every view/cast of one: the values that are full-size weights."""
    return weight_values(list(calls(graph, *GATHER_MARKERS)))


def weight_values(gathers: list[fx.Node]) -> list[fx.Node]:
    """`gathers` and every view or cast of their outputs."""
    found: dict[fx.Node, None] = {}
    frontier = list(gathers)
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
    weights = {n for n in gathered_weight_nodes(fw_gm.graph) if not n.meta.get(KEPT_FOR_BACKWARD)}
    fw_outputs = fw_gm.graph.output_node().args[0]
    saved_count = sum(1 for p in bw_gm.graph.nodes if p.op == "placeholder" and not p.name.startswith("tangents"))
    saved_outputs = fw_outputs[len(fw_outputs) - saved_count :] if saved_count else []
    saved = [n for n in saved_outputs if isinstance(n, fx.Node) and n in weights]
    if saved and not ctx.config.save_gathered_weights:
        raise GatheredWeightSavedError(
            f"{ctx.label}: the partitioner saved gathered weights {[n.name for n in saved]} for backward; "
            "this breaks the ZeRO-3 memory bound. Please report it with the dumped graphs (ZPP_DUMP_GRAPHS)."
        )
