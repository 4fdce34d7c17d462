"""hpz: the backward re-gathers a weight from secondary shards inside the node (ZeRO++ hpZ).

A partition pass: runs on the forward and backward graphs together, right after the min-cut
partition, because it changes what one saves and the other reads. K = hpz_size, k = this rank's
index in its hpZ group (K consecutive ranks of one node), W = world size.

Before (forward saves the primary shard; the backward re-gathers over the whole world):
    fw:  w = zpp.gather_param(shard, numel, shape, S, W, world)      ...  return (out, ..., shard)
    bw:  shard (input) -> w = zpp.gather_param(shard, numel, shape, S, W, world)

After, full-precision secondary (qwZ off):
    fw:  w = zpp.gather_param(shard, ...); sec = owned_slot(pad(w.view(-1)), K, hpz_group)  [k*W*S/K : (k+1)*W*S/K]
         return (out, ..., sec)
    bw:  sec (input) -> w = zpp.gather_param(sec, numel, shape, W*S/K, K, hpz_group, fqn=...)
    (Under mixed precision w, and so sec, are in param_dtype: the backward gather needs no cast.)

After, int8 secondary (a weight qwZ quantizes -- Config.qwz_parameters -- or a frozen weight stored
int8; Config.hpz_quantized_secondary):
    fw:  payload = quantize_packed(shard); g = wait(all_gather(payload))     (qwZ, inlined here)
         w = dequantize_packed(g)...;  sec = owned_slot(g, K, hpz_group)  [k*W/K payloads : (k+1)*W/K payloads]
    bw:  sec (input) -> w = zpp.gather_quantized_param(sec, numel, shape, S, block, dtype, K, hpz_group)
The K-rank gather of the W/K-payload slices rebuilds exactly the W payloads the forward gathered,
so the backward dequantizes the very bytes the forward did.

Either way `sec` is taken from the tensor the forward used, so backward values equal forward
values, and nothing persists between steps: no stale copy to invalidate (DeepSpeed's hpZ had
stale-copy and race bugs exactly there). The backward gather never leaves the node.
Config.hpz_parameters limits this to the weights it names: the others' saved shards and
backward gathers stay as before.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx

from ..codegen.quantize import payload_numel
from .context import PassContext
from .graph_utils import SHARD_GATHERS, aten, calls, finish, insert_call, replace_node
from .qwz import inline_int8_gather, quantized
from .tag_parameter_inputs import parameter_names_of

log = logging.getLogger(__name__)


def hpz(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, fx.GraphModule]:
    if ctx.topology.hpz_size == 1:
        log.debug("hpz: %s: hpZ is off; graphs unchanged", ctx.label)
        return fw_gm, bw_gm
    fw_gathers = {m.args[0].name: m for m in calls(fw_gm.graph, *SHARD_GATHERS) if m.args[0].op == "placeholder"}
    fw_outputs = list(fw_gm.graph.output_node().args[0])
    rewritten = 0
    covered, int8 = _covered(ctx), quantized(ctx)
    for saved in _saved_shards_regathered(bw_gm):
        marker = fw_gathers.get(saved.name)
        if marker is None or fw_outputs.count(marker.args[0]) != 1 or not covered(marker):
            continue
        index = fw_outputs.index(marker.args[0])
        with fw_gm.graph.inserting_before(marker.next):  # in order, right after the gather
            if _keeps_int8(marker, ctx, int8):
                fw_outputs[index], backward_gather = _int8_secondary(fw_gm.graph, marker, ctx)
            else:
                fw_outputs[index], backward_gather = _full_precision_secondary(fw_gm.graph, marker, ctx)
        _gather_secondary_in_backward(saved, fw_outputs[index], backward_gather)
        rewritten += 1
    if not rewritten:
        log.debug("hpz: %s: the backward re-gathers no weight; graphs unchanged", ctx.label)
        return fw_gm, bw_gm
    fw_gm.graph.output_node().args = (tuple(fw_outputs),)
    return finish(fw_gm), finish(bw_gm)


def _saved_shards_regathered(bw_gm: fx.GraphModule) -> list[fx.Node]:
    """Backward inputs that are only ever gathered: the primary shards the forward saved."""
    return [
        p
        for p in bw_gm.graph.nodes
        if p.op == "placeholder" and p.users and all(u.target in SHARD_GATHERS and u.args[0] is p for u in p.users)
    ]


def _covered(ctx: PassContext) -> Callable[[fx.Node], bool]:
    """forward marker -> whether hpZ covers the weight it gathers (Config.hpz_parameters)."""
    names, name_of = ctx.config.hpz_parameters, parameter_names_of(ctx)
    return lambda marker: names is None or name_of(marker) in names


def _keeps_int8(marker: fx.Node, ctx: PassContext, gathered_int8: Callable[[fx.Node], bool]) -> bool:
    if not ctx.config.hpz_quantized_secondary:
        return False
    return marker.target == torch.ops.zpp.gather_quantized_param.default or gathered_int8(marker)


def _full_precision_secondary(graph: fx.Graph, marker: fx.Node, ctx: PassContext) -> tuple[fx.Node, tuple]:
    """This rank's 1/K slice of the flat, padded full weight, and the backward gather's (target, args)."""
    # Both markers carry (numel, shape, shard_numel) at 1..3 and (group_size, group_name) last.
    numel, shape, shard_numel, group_size = *marker.args[1:4], marker.args[-2]
    total = shard_numel * group_size  # W * S, a multiple of K because K divides W
    flat = insert_call(graph, aten.view.default, marker, [-1])
    if total != numel:
        flat = insert_call(graph, aten.constant_pad_nd.default, flat, [0, total - numel])
    topology = ctx.topology
    secondary = _own_slice(graph, flat, ctx)
    args = (numel, shape, total // topology.hpz_size, topology.hpz_size, topology.hpz_group_name)
    return secondary, (torch.ops.zpp.gather_param.default, args)


def _int8_secondary(graph: fx.Graph, marker: fx.Node, ctx: PassContext) -> tuple[fx.Node, tuple]:
    """Inline the int8 gather here, keep this rank's slice of the gathered payloads."""
    group_size = marker.args[-2]
    weight, gathered, layout = inline_int8_gather(graph, marker, ctx.config.weight_block_size, ctx.decompositions)
    replace_node(marker, weight)
    secondary = _own_slice(graph, gathered, ctx)
    _, _, shard_numel, block, _ = layout
    assert secondary.meta["val"].numel() == group_size // ctx.topology.hpz_size * payload_numel(shard_numel, block)
    args = (*layout, ctx.topology.hpz_size, ctx.topology.hpz_group_name)
    return secondary, (torch.ops.zpp.gather_quantized_param.default, args)


def _own_slice(graph: fx.Graph, flat: fx.Node, ctx: PassContext) -> fx.Node:
    """This rank's 1/K of `flat` in a buffer of its own: the secondary shard."""
    topology = ctx.topology
    # Its own buffer, so the full weight can be freed after its last forward use; the slot found at
    # run time, so the ranks of an hpZ group have the same graph (ops.owned_slot).
    secondary = insert_call(graph, torch.ops.zpp.owned_slot.default, flat, topology.hpz_size, topology.hpz_group_name)
    secondary.meta["zpp_hpz_secondary"] = True
    return secondary


def _gather_secondary_in_backward(saved: fx.Node, secondary: fx.Node, backward_gather: tuple) -> None:
    """The backward input becomes the secondary shard; its gathers run over the hpZ group."""
    target, args = backward_gather
    value = secondary.meta["val"]
    saved.meta["val"] = saved.meta["val"].new_empty(value.shape, dtype=value.dtype)
    saved.meta.pop("tensor_meta", None)
    for marker in list(saved.users):
        with saved.graph.inserting_before(marker):
            # In the secondary's dtype already (param_dtype): no cast; the name stays for the check.
            gather = saved.graph.call_function(target, (saved, *args), {"fqn": marker.kwargs.get("fqn", "")})
        gather.meta = dict(marker.meta)
        replace_node(marker, gather)
