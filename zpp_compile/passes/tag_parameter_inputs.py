"""tag_parameter_inputs: note on each parameter read which graph input it reads.

Runs on Dynamo's graph, after dedupe_gathers. The schedule check names the parameters a graph
gathers (so ranks gathering different parameters of one shape are told which), but the graph must
not hold the names: a graph Dynamo reuses for several modules (a loop skipped for a graph break,
regional compilation) would then be specialised, and recompiled, per module. Instead each marker
records the position of its graph input in node.meta["custom"] (a field AOTAutograd copies onto
the nodes it traces from this one), and the backend looks the name up at run time, on the
parameters the graph is called with.
Before:  w = zpp.gather_param(L_self_fc_weight_.to_local(), ...)
After:   the same, with w.meta["custom"]["zpp_param_input"] = 3  (L_self_fc_weight_ is input 3)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from .context import PassContext
from .graph_utils import GATHER_MARKERS, graph_input_of

PARAM_INPUT = "zpp_param_input"


def tag_parameter_inputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    position = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    markers = set(GATHER_MARKERS) | {m.overloadpacket for m in GATHER_MARKERS}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in markers:
            source = graph_input_of(node.args[0])
            if source in position:
                node.meta.setdefault("custom", {})[PARAM_INPUT] = position[source]
    return gm


def parameter_names_of(ctx: PassContext) -> Callable[[fx.Node], Optional[str]]:
    """marker -> the name of the parameter it reads, in the call this graph was compiled for (a
    graph run for several modules keeps the first one's); None where it reads no tagged input."""
    names = dict(zip(ctx.parameter_positions, ctx.parameter_names))
    return lambda marker: names.get(marker.meta.get("custom", {}).get(PARAM_INPUT))
