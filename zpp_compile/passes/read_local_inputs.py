"""read_local_inputs: every parameter read takes the graph input itself, not DTensor's alias of it.

Runs on the joint graph, first. A sharded parameter is a DTensor; AOTAutograd passes its local
chunk into the graph, and `param.to_local()` traces to an identity view of that input.
Before:  view = aten.view(primals_2, [16, 32])                      # to_local(): same shape
         w = zpp.gather_param(view, 2048, [64, 32], 512, 4, '0')
After:   w = zpp.gather_param(primals_2, 2048, [64, 32], 512, 4, '0')
So the partitioner saves (and hpZ replaces) the input itself, and passes can tell a gathered
parameter by its marker's first argument being a placeholder.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from .context import PassContext
from .graph_utils import GATHER_MARKERS, aten, calls, finish, is_call

log = logging.getLogger(__name__)


def read_local_inputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    changed = 0
    for marker in calls(gm.graph, *GATHER_MARKERS):
        source = marker.args[0]
        if _is_identity_view_of_input(source):
            marker.replace_input_with(source, source.args[0])
            if not source.users:
                gm.graph.erase_node(source)
            changed += 1
    if not changed:
        log.debug("read_local_inputs: %s: every gather already reads its input; graph unchanged", ctx.label)
        return gm
    return finish(gm)


def _is_identity_view_of_input(node: fx.Node) -> bool:
    if not is_call(node, aten.view.default, aten.alias.default):
        return False
    source = node.args[0]
    return source.op == "placeholder" and source.meta["val"].shape == node.meta["val"].shape
