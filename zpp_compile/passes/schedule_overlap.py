"""schedule_overlap: issue each collective early enough to hide behind compute, wait for it late.

Runs last on the lowered forward and backward graphs (after bucket_collectives), when the context
carries a cost model (Config.prefetch_limit > 0).
Before:  each collective is issued where its result is first needed and waited right away:
             ... compute_1 ... ; c_k = all_gather(payload_k); w_k = wait(c_k); use(w_k)
After:   1. each wait, with the nodes that only unpack its result (slices, views, dequantize),
            moves down to just before the first node that needs it. A collective is not
            unpacking: where one stage's result is the next stage's payload (hierarchical_reduce
            and qgz send the in-node sums across nodes), the next stage leaves right after the
            wait, while the backward still computes, instead of sinking with it to the end;
         2. each collective start, with the nodes that only prepare its input (quantize, pad,
            concat), moves up: far enough that the compute between it and its wait covers its
            estimated transfer time (cost_model), never above its inputs, never above the
            previous collective (same issue order on every rank), and never while
            Config.prefetch_limit collectives or Config.prefetch_bytes bytes are already in
            flight at that point.
Gradient collectives start where their bucket is complete (their inputs), since nothing later
depends on them but the output. Only graph order changes; values are identical.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from ..comm import group_ranks
from .buckets import tensor_bytes
from .context import PassContext
from .graph_utils import COLLECTIVE_STARTS, finish, is_call

log = logging.getLogger(__name__)


def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.cost_model is None or ctx.config.prefetch_limit == 0:
        log.debug("schedule_overlap: %s: prefetch is off; graph unchanged", ctx.label)
        return gm
    starts = [n for n in gm.graph.nodes if is_call(n, *COLLECTIVE_STARTS)]
    if not starts:
        log.debug("schedule_overlap: %s has no collectives; graph unchanged", ctx.label)
        return gm
    for start in starts:
        _sink_wait(_wait_of(start))
    for index, start in enumerate(starts):
        _hoist_start(start, starts[:index], ctx)
    return finish(gm)


def _wait_of(start: fx.Node) -> fx.Node:
    (wait,) = start.users
    return wait


# -- 1. waits go down ---------------------------------------------------------------------------


def _sink_wait(wait: fx.Node) -> None:
    chain = _unpacking_chain(wait)
    users = [u for n in chain for u in n.users if u not in chain]
    if not users:
        return
    order = _positions(wait.graph)
    first_use = min(users, key=order.__getitem__)
    # Buffers the chain writes into (a Triton kernel's `empty` output) may sit below first_use:
    # they move up with it. Nothing above first_use uses them, so moving them is safe.
    late_buffers = {arg for arg in _constant_inputs(chain) if order[arg] > order[first_use]}
    for node in sorted(chain | late_buffers, key=order.__getitem__):
        first_use.prepend(node)


def _constant_inputs(chain: set[fx.Node]) -> set[fx.Node]:
    """Inputs of the chain that need no input themselves (empty, zeros, full)."""
    return {arg for node in chain for arg in node.all_input_nodes if arg not in chain and _is_constant(arg)}


def _is_constant(node: fx.Node) -> bool:
    return node.op == "call_function" and not node.all_input_nodes


def _unpacking_chain(wait: fx.Node) -> set[fx.Node]:
    """The wait and the nodes below it that need nothing else computed (only it, or constants),
    short of any collective start."""
    chain = {wait}
    frontier = [wait]
    while frontier:
        for user in list(frontier.pop().users):
            # A collective fed by the result (a hierarchical reduce's second stage) is issued,
            # not unpacked: carried along, it would sink with the wait to the graph's end.
            if user in chain or user.op != "call_function" or is_call(user, *COLLECTIVE_STARTS):
                continue
            if all(arg in chain or _is_constant(arg) for arg in user.all_input_nodes):
                chain.add(user)
                frontier.append(user)
    return chain


# -- 2. starts go up ----------------------------------------------------------------------------


def _hoist_start(start: fx.Node, earlier: list[fx.Node], ctx: PassContext) -> None:
    chain = _preparing_chain(start)
    nodes = list(start.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    inputs = [order[arg] for n in chain for arg in n.all_input_nodes if arg not in chain]
    floor = max(inputs + [_last_placeholder(nodes)])
    if earlier:
        floor = max(floor, order[earlier[-1]])
    floor = max(floor, _in_flight_floor(start, earlier, order, ctx))
    target = _cost_target(start, chain, nodes, order, floor, ctx)
    if target >= min(order[n] for n in chain):
        return
    anchor = nodes[target]
    for node in sorted(chain, key=order.__getitem__, reverse=True):
        anchor.append(node)


def _last_placeholder(nodes: list[fx.Node]) -> int:
    return max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)


def _preparing_chain(start: fx.Node) -> set[fx.Node]:
    """The start and the nodes above it that exist only to feed it (quantize, pad, concat)."""
    chain = {start}
    frontier = [start]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg.op == "call_function" and arg not in chain and all(u in chain for u in arg.users):
                chain.add(arg)
                frontier.append(arg)
    return chain


def _in_flight_floor(start: fx.Node, earlier: list[fx.Node], order: dict[fx.Node, int], ctx: PassContext) -> int:
    """The lowest position at which `start` keeps the in-flight limits: it may not start before
    the wait of the collective `prefetch_limit` places earlier, nor before enough earlier waits
    that the bytes in flight stay under prefetch_bytes."""
    limit, budget = ctx.config.prefetch_limit, ctx.config.prefetch_bytes
    floor = order[_wait_of(earlier[-limit])] if len(earlier) >= limit else -1
    in_flight = tensor_bytes(start)
    for previous in reversed(earlier):
        in_flight += tensor_bytes(previous)
        if in_flight > budget:
            return max(floor, order[_wait_of(previous)])
    return floor


def _cost_target(
    start: fx.Node, chain: set[fx.Node], nodes: list[fx.Node], order: dict[fx.Node, int], floor: int, ctx: PassContext
) -> int:
    """Walk up from the start's current place until the compute passed over covers its transfer."""
    needed = _transfer_seconds(start, ctx)
    position = min(order[n] for n in chain) - 1
    covered = 0.0
    while position > floor and covered < needed:
        covered += ctx.cost_model.node_seconds(nodes[position])
        position -= 1
    return max(position, floor)


def _transfer_seconds(start: fx.Node, ctx: PassContext) -> float:
    """The cost model's time for this collective: the bytes it sends, over the slowest link it spans."""
    sent = start.args[0].meta["val"]
    nodes = {rank // ctx.topology.ranks_per_node for rank in group_ranks(start.args[-1])}
    return ctx.cost_model.collective_seconds(sent.numel() * sent.element_size(), crosses_nodes=len(nodes) > 1)


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}
