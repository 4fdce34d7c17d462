"""bucket_collectives: merge neighbouring all-gathers, reduce-scatters and all-reduces with Inductor's bucketing.

Runs on the lowered forward and backward graphs (functional collectives, after the quantizing
passes), so the bytes it counts are the bytes that travel: int8 payloads under qwZ, the in-node
group under hpZ. Inductor's passes (torch._inductor.fx_passes.bucketing) group collectives of the
same group and dtype that are adjacent in wait order and independent of each other, up to a
size cap, and rewrite each group into one collective on a concatenated buffer. In a graph cut by
block (buckets.cuts_at_blocks) a bucket never spans two repeated blocks (buckets.py says why).
Before:  a = wait(all_gather(x, 4, g)); b = wait(all_gather(y, 4, g))
After:   ab = wait(all_gather(cat(x, y), 4, g)); a, b = the per-rank slices of ab, copied out
A merged gather takes the concatenation as its input, not this rank's slot of its output buffer
(Inductor's form, copy_(slot, cat) then all_gather(slot, out=buffer), puts the rank's offset into
the graph): so every rank's graph is the same, and a host compiles it once (compile_sharing). In
a graph Inductor compiles whole, the gather becomes the out-of-place all_gather(cat), whose input
Inductor keeps alive until the wait. Where Inductor's merge folded the casts before the gathers
into its copy (mixed precision: each shard cast to Config.param_dtype), the gather sends the cast
concatenation, all_gather(convert(cat(shards), param_dtype)): no rank offset there either.
qgZ's all-to-alls are bucketed by qgz itself (Inductor does not bucket all-to-all).
All-reduces (gradients of parameters every rank holds whole: 0-d ones, and those of at most
Config.keep_whole_numel elements; no pass emits others, a model's own sum all-reduces on the world
group would join them) are small, so their buckets span blocks: one collective per step, up to
the cap, rather than one more per block.
Before:  a = wait(all_reduce(ga, "sum", g)); b = wait(all_reduce(gb, "sum", g))
After:   ab = wait(all_reduce(cat(ga, gb), "sum", g)); a, b = the slices of ab
Caps: Config.gather_bucket_bytes and Config.reduce_bucket_bytes (all-reduces too); 0 turns either off.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx
from torch._inductor.fx_passes.bucketing import (
    bucket_key,
    greedy_bucket_collective_by_mb,
    is_all_gather_into_tensor,
    is_all_reduce_tensor,
    is_reduce_scatter_tensor,
    merge_all_gather,
    merge_all_reduce_bucket,
    merge_reduce_scatter,
)

from .buckets import blocks_of, compiled_whole_reason
from .context import PassContext
from .graph_utils import (
    COLLECTIVE_STARTS,
    calls,
    finish,
    insert_call,
    is_call,
    random_nodes,
    stable_topological_sort,
)

log = logging.getLogger(__name__)
aten, c10d = torch.ops.aten, torch.ops._c10d_functional

_MIB = 2**20


def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    before = _count(gm)
    draws = random_nodes(gm.graph)
    gather_cap, reduce_cap = ctx.config.gather_bucket_bytes, ctx.config.reduce_bucket_bytes
    by_block = blocks_of(ctx)
    for cap, is_kind, merge, block_of in (
        (gather_cap, is_all_gather_into_tensor, merge_all_gather, by_block),
        (reduce_cap, is_reduce_scatter_tensor, merge_reduce_scatter, by_block),
        (reduce_cap, is_all_reduce_tensor, _merge_all_reduces, lambda node: None),
    ):
        buckets = _buckets(gm, is_kind, cap, block_of) if cap else []
        if buckets:
            merge(gm, buckets, "default")
    if collectives_run_outside_inductor(gm, ctx):
        _gather_from_concatenation(gm)
    else:
        _gather_out_of_place(gm)
    after = _count(gm)
    if after == before:
        log.debug("bucket_collectives: %s: nothing to merge; graph unchanged", ctx.label)
        return gm
    log.debug("bucket_collectives: %s: %d collectives -> %d", ctx.label, before, after)
    # Inductor's merge sits at the last member: pull it above the first use, random ops kept in order.
    stable_topological_sort(gm.graph, draws)
    return finish(gm)


def _buckets(
    gm: fx.GraphModule, is_kind: Callable[[fx.Node], bool], cap: int, block_of: Callable[[fx.Node], object]
) -> list:
    """Inductor's greedy buckets of one kind of collective, grouped by (group, dtype) as Inductor
    does and, in a graph cut by block, by block: the packing restarts with every block, so each
    block is cut alike."""
    return greedy_bucket_collective_by_mb(
        gm, lambda _: cap / _MIB, is_kind, lambda node: (bucket_key(node, "default"), block_of(node))
    )


def _merge_all_reduces(gm: fx.GraphModule, buckets: list[list[fx.Node]], mode: str) -> None:
    """Inductor merges all-reduces one bucket at a time (its gather and reduce-scatter merges take
    the list)."""
    for bucket in buckets:
        if len(bucket) > 1:
            merge_all_reduce_bucket(gm.graph, bucket, mode)


def collectives_run_outside_inductor(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether the graph's collectives will run as FX nodes (compiled by region, or not compiled),
    where a collective's input lives as long as the collective holds it. Inside a graph Inductor
    compiles whole, its memory planner hands a buffer to the next kernel after its last read: the
    collective call, for an input only the (asynchronous) collective reads. Its wait keeps alive
    what it returns and the inputs of out-of-place collectives, not the input of an `_out` one."""
    return ctx.config.lowering == "aot_eager" or compiled_whole_reason(gm, ctx) is None


def _gather_from_concatenation(gm: fx.GraphModule) -> None:
    """all_gather_out(copy_(slice(out, rank*n, ...), cat), out=out) -> all_gather_out(cat, out=out):
    the collective copies the input into this rank's slot itself, so a region's code carries no
    rank offset. Only where the collectives run outside Inductor: nothing then keeps `cat` alive
    until the wait in a graph Inductor compiles whole (it reused the buffer for the next kernel
    while gloo was still sending it: wrong gradients, tests/test_scheduling.py)."""
    for gather, copied, slot, concatenated, _ in _copies_into_the_slot(gm):
        gather.replace_input_with(copied, _what_the_copy_sends(gm.graph, copied, slot, concatenated))
        gm.graph.erase_node(copied)
        gm.graph.erase_node(slot)


def _gather_out_of_place(gm: fx.GraphModule) -> None:
    """all_gather_out(copy_(slice(out, rank*n, ...), cat), out=out) -> all_gather(cat), in a graph
    Inductor compiles whole: Inductor keeps an out-of-place collective's input alive until its
    wait (NOTE [Out-of-Place Collective Safety]), which it does not do for an `_out` one's. The
    graph then carries no rank offset, so the ranks of a host that compile it alike compile it
    once between them (compile_sharing). The cost: `cat` lives until the wait, and the collective
    copies it into this rank's slot (1/group of the output) instead of the kernel writing there."""
    for gather, copied, slot, concatenated, out in _copies_into_the_slot(gm):
        if set(out.users) != {gather, slot}:  # `out` read other than through the gather
            continue
        sent = _what_the_copy_sends(gm.graph, copied, slot, concatenated)
        with gm.graph.inserting_before(gather):
            gathered = gm.graph.call_function(c10d.all_gather_into_tensor.default, (sent, *gather.args[1:]))
        gathered.meta = dict(gather.meta)
        gather.replace_all_uses_with(gathered)
        for node in (gather, copied, slot, out):
            gm.graph.erase_node(node)


def _copies_into_the_slot(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node, fx.Node]]:
    """(gather, copy_, slot, cat, out) of each bucketed gather in Inductor's form:
    all_gather_out(copy_(slot = slice(out, rank*n, ...), cat), out=out). The copy may cast: Inductor's
    bucketing folds a cast right before a gather into it (mixed precision's, lower_gather)."""
    found = []
    for gather in calls(gm.graph, c10d.all_gather_into_tensor_out.default):
        copied, out = gather.args[0], gather.kwargs.get("out")
        if not (is_call(copied, aten.copy_.default) and len(copied.users) == 1):
            continue
        slot, concatenated = copied.args[:2]
        if is_plain_copy_into_slot_of(out, slot, concatenated, allow_cast=True):
            found.append((gather, copied, slot, concatenated, out))
    return found


def is_plain_copy_into_slot_of(out: fx.Node, slot: fx.Node, source: fx.Node, *, allow_cast: bool = False) -> bool:
    """slot is a slice of `out` read by nothing but the copy, and the copy does not broadcast
    `source`, nor cast it unless `allow_cast`."""
    if not (is_call(slot, aten.slice.Tensor) and slot.args[0] is out and len(slot.users) == 1):
        return False
    into, value = slot.meta["val"], source.meta["val"]
    return (allow_cast or into.dtype == value.dtype) and into.shape == value.shape


def _what_the_copy_sends(graph: fx.Graph, copied: fx.Node, slot: fx.Node, source: fx.Node) -> fx.Node:
    """`source`, cast to the slot's dtype where the copy into the slot casts it."""
    dtype = slot.meta["val"].dtype
    if source.meta["val"].dtype == dtype:
        return source
    with graph.inserting_before(copied):
        return insert_call(graph, torch.ops.prims.convert_element_type.default, source, dtype)


def _count(gm: fx.GraphModule) -> int:
    return len(list(calls(gm.graph, *COLLECTIVE_STARTS)))
