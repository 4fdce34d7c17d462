"""sink_large_results: a large result is made after the large values that die before it is read.

Runs on the lowered backward, before the scheduling passes. A linear layer's backward computes
the weight's gradient (dW = dYᵀ X) and the input's gradient (dX = dY W) in the order autograd
emitted them, often dW first. Where the weight was gathered again for the backward (hpZ, qwZ's
int8 gather then dequantize, or any weight not kept from the forward) and is large, as a tied
embedding is, dW, the gathered weight and its int8 buffer were then alive at once: on Hugging
Face GPT-2 small with full ZeRO++ that was the step's peak (147 + 147 + 37 MiB above the logits'
gradient). Made after dX, dW never meets the weight it does not read.

Before:  dW = mm(dYᵀ, X) ; w8 = all_gather(shard) ; W = dequantize(wait(w8)) ; dX = mm(dY, W) ; ... use(dW)
After:   w8 = all_gather(shard) ; W = dequantize(wait(w8)) ; dX = mm(dY, W) ; dW = mm(dYᵀ, X) ; ... use(dW)

A node N of LARGE_BYTES or more moves down to just after the last node M, before N's first
reader, at which a value of LARGE_BYTES or more (not N's input) is last read: its storage, read
through views and waits (graph_utils.shares_input_storage). It moves only as far
as the inputs whose lifetime the move extends (those that would die before M, not at M) take no
more bytes than N's result nor than that value: memory then falls between N's old place and M and rises
nowhere. On GPT-2 the head's gradient moves to the end of the backward, past the last large
temporaries, and the logits' gradient it reads (a third of its size) lives until then instead.
N is a pure op returning a tensor of its own, not a random draw (they draw in program order),
and it never moves past a node with side effects other than a collective's issue or wait.
Collectives and waits do not move, so the order of collectives is unchanged (invariant 1), and
graphs with symbolic sizes are left alone (their bytes are expressions). Only graph order changes;
values are identical. schedule_overlap, which runs after, places the collectives around the new
order.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx

from .buckets import tensor_bytes
from .context import PassContext
from .graph_utils import COLLECTIVE_STARTS, finish, has_static_geometry, is_random, shares_input_storage

log = logging.getLogger(__name__)

# Smaller results are not worth reordering for (a transformer block's weights are a few MiB); the
# same size from which gloo collectives are rooted (root_large_collectives).
LARGE_BYTES = 16 * 2**20


def sink_large_results(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    moved = 0
    movable = [n for n in gm.graph.nodes if _is_movable(n)]
    order, death = _liveness(gm.graph) if movable else ({}, {})
    for node in movable:
        if _sink(node, order, death):
            moved += 1
            order, death = _liveness(gm.graph)  # only a move changes them
    if not moved:
        log.debug("sink_large_results: %s: no large result to make later; graph unchanged", ctx.label)
        return gm
    log.debug("sink_large_results: %s: %d large results made later", ctx.label, moved)
    return finish(gm)


def _is_movable(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and hasattr(node.target, "_schema")
        and _bytes(node) >= LARGE_BYTES  # first: the rarest, and cheaper than is_impure
        and not node.target._schema.is_mutable
        and not node.is_impure()
        and not is_random(node)  # random ops draw in program order (fallback_random)
        and not shares_input_storage(node)  # a view or wait owns no memory to make later
        and node.target not in COLLECTIVE_STARTS
    )


def _sink(node: fx.Node, order: dict[fx.Node, int], death: dict[fx.Node, int]) -> bool:
    """Move `node` down past the last large value that dies before its first reader."""
    if not node.users:
        return False
    first_read = min(order[u] for u in node.users)
    inputs = {_root(i) for i in node.all_input_nodes}
    input_lives = [(death[i], _storage_bytes(i)) for i in inputs]
    own_bytes = _bytes(node)
    target: Optional[fx.Node] = None
    for later in _between(node, first_read, order):
        if _writes_or_hides(later):
            break
        # Inputs that would die before node's new place live until it instead; one read last by
        # `later` itself is alive there anyway.
        extended = sum(size for dies, size in input_lives if dies < order[later])
        if extended > own_bytes:
            break
        dying = {_root(v) for v in later.all_input_nodes} - inputs
        if any(death[v] == order[later] and _storage_bytes(v) >= max(LARGE_BYTES, extended) for v in dying):
            target = later
    if target is None:
        return False
    target.append(node)
    return True


def _writes_or_hides(node: fx.Node) -> bool:
    """A node with side effects other than a collective's: waits are marked impure only so that
    nothing drops them, and collectives read their inputs, which the move leaves alone."""
    return node.is_impure() and not (node.target in COLLECTIVE_STARTS or node.target in _WAITS)


_WAITS = (torch.ops._c10d_functional.wait_tensor.default, torch.ops.zpp.wait_rooted.default)


def _between(node: fx.Node, stop: int, order: dict[fx.Node, int]) -> list[fx.Node]:
    nodes = []
    cursor = node.next
    while order.get(cursor, stop) < stop:
        nodes.append(cursor)
        cursor = cursor.next
    return nodes


def _root(node: fx.Node) -> fx.Node:
    """The value whose storage `node` views or waits for (itself when it has a storage of its own)."""
    while shares_input_storage(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _liveness(graph: fx.Graph) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Each node's position, and the position of the last node that reads each value's storage
    (a view's and a wait's readers read their input's)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    death: dict[fx.Node, int] = {}
    for n in reversed(graph.nodes):
        death[n] = max((death[u] if shares_input_storage(u) else order[u] for u in n.users), default=order[n])
    return order, death


def _static_tensor(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and has_static_geometry(value)


def _bytes(node: fx.Node) -> int:
    return tensor_bytes(node) if _static_tensor(node) else 0


def _storage_bytes(node: fx.Node) -> int:
    """Bytes a value keeps alive: its whole storage when it is a view."""
    if not _static_tensor(node):
        return 0
    try:
        return node.meta["val"].untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # no storage (sparse, subclasses)
        return tensor_bytes(node)
