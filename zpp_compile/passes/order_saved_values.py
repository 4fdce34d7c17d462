"""order_saved_values: the values the forward saves, in the order AOTAutograd's runtime reads them.

A partition pass, run last. AOTAutograd's runtime takes the forward's saved values as
[tensors | opaque objects | symints] and hands the backward [symints | tensors | opaque objects |
tangents ...]. With DTensor parameters, the backward needs each DTensor's mesh (an opaque object)
to rebuild the parameters' gradients; when a checkpointed region also saves its RNG state, the
torch 2.13 partitioner puts those RNG tensors after the meshes, and the runtime then takes a mesh
for a tensor ("expected all tensors_saved_with_vc_check to be Tensors": Hugging Face models with
gradient_checkpointing_enable()). This pass restores the order on both sides.
Before:  fw returns (out, a, mesh, rng_state, s0)     bw(s0, a, mesh, rng_state, tangent)
After:   fw returns (out, a, rng_state, mesh, s0)     bw(s0, a, rng_state, mesh, tangent)
"""

from __future__ import annotations

import logging

import torch.fx as fx
from torch._functorch._aot_autograd.graph_compile import is_opaque_node
from torch._functorch.partitioners import is_sym_node

from .context import PassContext
from .graph_utils import finish

log = logging.getLogger(__name__)


def order_saved_values(
    fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, ctx: PassContext
) -> tuple[fx.GraphModule, fx.GraphModule]:
    saved_inputs = [p for p in bw_gm.graph.nodes if p.op == "placeholder" and not p.name.startswith("tangents")]
    outputs = list(fw_gm.graph.output_node().args[0])
    first_saved = len(outputs) - len(saved_inputs)
    saved = outputs[first_saved:]
    symints = [n for n in saved if is_sym_node(n)]
    # The partitioner's convention: the forward saves [values | symints], the backward takes
    # [symints | values], each value at the same position (names may differ: RNG states).
    pairs = list(zip(saved[: len(saved) - len(symints)], saved_inputs[len(symints) :]))
    ordered = [pair for pair in pairs if not is_opaque_node(pair[0])] + [
        pair for pair in pairs if is_opaque_node(pair[0])
    ]
    if ordered == pairs or saved[len(pairs) :] != symints:
        log.debug("order_saved_values: %s: saved values already in order; graphs unchanged", ctx.label)
        return fw_gm, bw_gm
    fw_gm.graph.output_node().args = (tuple(outputs[:first_saved] + [f for f, _ in ordered] + symints),)
    _move_to_front(bw_gm.graph, saved_inputs[: len(symints)] + [b for _, b in ordered])
    return finish(fw_gm), finish(bw_gm)


def _move_to_front(graph: fx.Graph, placeholders: list[fx.Node]) -> None:
    """Make `placeholders` the graph's first inputs, in this order (the rest keep theirs)."""
    anchor = next(iter(graph.nodes))
    for node in reversed(placeholders):
        if node is not anchor:
            anchor.prepend(node)
        anchor = node
