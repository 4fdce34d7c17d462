"""root_large_collectives: large all-gathers and reduce-scatters on gloo take the rooted, unstaged form.

gloo's tensor collectives stage the whole tensor in a buffer of their own (eager_collectives.py);
at GPT-2 small that is 147 MB more at the tied embedding's reduce-scatter, the backward's peak.
For tensors of at least eager_collectives.ROOTED_MIN_BYTES on a group gloo carries, this pass
swaps the functional collective for rooted_ops.py's asynchronous per-owner form, issued and
waited on where the functional one was, so the overlap the scheduling passes set up is kept.

Before:  padded = aten.constant_pad_nd(aten.view(g, [-1]), [0, p])    (lower_reduce's zero pad, if any)
         r = _c10d_functional.reduce_scatter_tensor(padded, "sum", n, group)
         r = _c10d_functional.wait_tensor(r)
         ... = use(r)
After:   flat = aten.view(g, [-1])
         r = zpp.rooted_reduce_scatter(flat, r's numel, n, group)  # reduces `flat` in place
         zpp.wait_rooted(r, flat)                                   # `flat` kept alive to here
         ... = use(r)

Before:  g = _c10d_functional.all_gather_into_tensor(shard, n, group)
         g = _c10d_functional.wait_tensor(g)
After:   g = zpp.rooted_all_gather(shard, n, group)
         zpp.wait_rooted(g, None)

A reduce-scatter is rooted only when its input is a buffer of its own that nothing else reads
(a gradient a matmul returns, which fold_scatter_grads' zpp.add_rows may have written into; the
pad or concatenation lower_reduce and bucketing make; not a view of another tensor, not a graph
input), because the rooted form overwrites it. Under a zero pad it takes the gradient itself when
that is such a buffer: the rooted form reads no padding, so the pad's whole-tensor copy goes.
Runs last: it changes how a collective travels, not which collectives there are or where they
start and finish. Other backends (NCCL) stage nothing and keep the functional form; Inductor's
_out all-gather form is kept as well.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from .. import eager_collectives
from .bucket_collectives import collectives_run_outside_inductor, is_plain_copy_into_slot_of
from .context import PassContext
from .graph_utils import aten, c10d, calls, finish, insert_call, is_call, is_fresh_buffer, tensor_val, zero_pad_at_end

log = logging.getLogger(__name__)
zpp = torch.ops.zpp


def root_large_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    rooted = 0
    # Inside a graph Inductor compiles whole, the wait must read a reduce's input, or Inductor
    # reuses the buffer for another kernel while gloo writes it; run as FX nodes, the input is
    # freed when gloo finishes with it (rooted_ops.py).
    keep_inputs = not collectives_run_outside_inductor(gm, ctx)
    for start in calls(gm.graph, *_ROOTABLE):
        wait = _only_wait(start)
        payload = _payload(start) if wait is not None and _large_on_gloo(start) else None
        if payload is None:
            continue
        _swap(gm.graph, start, wait, payload, keep_inputs)
        rooted += 1
    if rooted:
        log.debug("root_large_collectives: %s: %d collectives rooted", ctx.label, rooted)
    return finish(gm)


_GATHERS = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)
_ROOTABLE = (*_GATHERS, c10d.reduce_scatter_tensor.default)


def _only_wait(start: fx.Node) -> Optional[fx.Node]:
    users = list(start.users)
    return users[0] if len(users) == 1 and is_call(users[0], c10d.wait_tensor.default) else None


def _large_on_gloo(start: fx.Node) -> bool:
    """Whether the collective's whole tensor (a gather's output, a reduce's input) is large enough
    for the rooted form on its group's backend: eager_collectives' rule, read at compile time."""
    whole = tensor_val(start) if start.target in _GATHERS else tensor_val(start.args[0])
    return eager_collectives.uses_rooted_form(whole, _resolve_process_group(start.args[-1]))


def _payload(start: fx.Node) -> Optional[fx.Node]:
    """What the rooted form sends, or None where the collective is kept. Flat tensors only (what
    zpp_compile lowers to): the rooted forms return flat results, and a user's own collective of
    a 2-D tensor would hand its readers the wrong shape."""
    if tensor_val(start.args[0]).dim() != 1:
        return None
    if start.target == c10d.all_gather_into_tensor.default:
        return start.args[0]
    if start.target == c10d.all_gather_into_tensor_out.default:
        return _payload_of_gather_out(start)
    return _reduced_buffer(start)


def _payload_of_gather_out(gather: fx.Node) -> Optional[fx.Node]:
    """Bucketing's gather: out = empty(); all_gather_out(copy_(slice(out, this rank's slot), cat),
    out=out) (or all_gather_out(cat, out=out)): `cat`, where `out` is read only through the wait."""
    sent, out = gather.args[0], gather.kwargs.get("out")
    if not is_call(out, aten.empty.memory_format):
        return None
    if not is_call(sent, aten.copy_.default):
        return sent if len(out.users) == 1 else None
    slot, copied = sent.args[:2]
    if set(out.users) != {gather, slot} or len(sent.users) != 1:
        return None
    return copied if is_plain_copy_into_slot_of(out, slot, copied) else None


def _reduced_buffer(start: fx.Node) -> Optional[fx.Node]:
    """What the rooted reduce-scatter reduces in place, or None where the functional one stays.
    The rooted form reads no padding (shards past its input's end count as zeros), so under the
    reduction's zero pad it takes the unpadded tensor where that is a buffer of its own: the
    pad's copy is then never made. Otherwise the tensor the collective reads, if it is one."""
    if start.args[1] != "sum":
        return None
    sent = start.args[0]
    if zero_pad_at_end(sent) is not None and _writable(sent.args[0], sent):
        return sent.args[0]
    return sent if _writable(sent, start) else None


def _writable(node: fx.Node, reader: fx.Node) -> bool:
    """`node` re-views (through views each read only by the next) a buffer of its own that nothing
    reads but `reader`; fold_scatter_grads' zpp.add_rows may have written into it before."""
    while is_call(node, aten.view.default) and list(node.users) == [reader]:
        node, reader = node.args[0], node
    readers = [u for u in node.users if not (is_call(u, zpp.add_rows.default) and u.args[0] is node)]
    return readers == [reader] and _is_own_buffer(node)


def _is_own_buffer(node: fx.Node) -> bool:
    """A non-zero pad; a concatenation of two or more parts nothing else reads (Inductor may
    compute those straight into the concatenation's buffer and let their other readers read it
    there); any other op that returns a new tensor Inductor keeps (graph_utils.is_fresh_buffer)."""
    if is_call(node, aten.constant_pad_nd.default):
        return any(node.args[1])
    if is_call(node, aten.cat.default):
        return len(node.args[0]) > 1 and all(len(part.users) == 1 for part in node.args[0])
    return is_fresh_buffer(node)


def _swap(graph: fx.Graph, start: fx.Node, wait: fx.Node, payload: fx.Node, keep_input: bool) -> None:
    gather = start.target in _GATHERS
    group_size, group_name = start.args[-2], start.args[-1]
    with graph.inserting_before(start):
        if gather:
            issued = insert_call(graph, zpp.rooted_all_gather.default, payload, group_size, group_name)
        else:  # the shard's size: the payload may be the reduction's input before its zero pad
            shard_numel = tensor_val(start).numel()
            issued = insert_call(graph, zpp.rooted_reduce_scatter.default, payload, shard_numel, group_size, group_name)
    issued.meta["custom"] = dict(start.meta.get("custom", {}))
    with graph.inserting_before(wait):
        insert_call(graph, zpp.wait_rooted.default, issued, payload if keep_input and not gather else None)
    wait.replace_all_uses_with(issued)
    sent, out = start.args[0], start.kwargs.get("out")
    graph.erase_node(wait)
    graph.erase_node(start)
    # Bucketing's gather: its copy into this rank's slot of `out`, the slot and `out` go unread.
    leftovers = [sent, sent.args[0]] if sent is not payload else []
    for node in (*leftovers, out):
        if node is not None and not node.users:
            graph.erase_node(node)
