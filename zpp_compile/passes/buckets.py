"""Bucketing: which collective markers travel together as one collective.

A bucket is a run of consecutive markers in graph order whose payloads add up to at most the
Config's bucket size (a single marker larger than that is a bucket of its own), in a graph cut by
block all of one block (below). Graph order is the same on every rank, so the buckets are too (invariant 1 of README.md).

Blocks (cuts_at_blocks): a bucket never spans two repeated blocks of the model (the parameters of
"transformer.h.3." and those of "transformer.h.4."). So every block's collectives, and the
computation between them, are the same from block to block, and Inductor compiles one block's
regions once for all of them (see inductor_regions.py). FSDP2 gets the same from fully_shard per
block.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from ..layout import block_of_name
from .context import PassContext
from .graph_utils import first_symbolic_node
from .tag_parameter_inputs import parameter_names_of


def bucket_by_bytes(
    nodes: list[fx.Node], nbytes: Callable[[fx.Node], int], cap: int, block: Callable[[fx.Node], Optional[str]]
) -> list[list[fx.Node]]:
    """Split `nodes` (in graph order) into consecutive runs of at most `cap` bytes (cap 0: one
    each), each of one `block`."""
    buckets: list[list[fx.Node]] = []
    filled = 0
    for node in nodes:
        size = nbytes(node)
        if not buckets or filled + size > cap or block(node) != block(buckets[-1][-1]):
            buckets.append([])
            filled = 0
        buckets[-1].append(node)
        filled += size
    return buckets


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces (its fake value)."""
    value = node.meta["val"]
    return value.numel() * value.element_size()


# Config.inductor_regions=None cuts by block from this many repeated blocks on: below it, regions
# repeat too little to pay for compiling them one by one, and buckets across blocks mean fewer
# collectives.
MIN_BLOCKS = 4


def cuts_at_blocks(ctx: PassContext) -> bool:
    """Whether this graph's buckets stop at block boundaries and Inductor compiles it by region."""
    if ctx.config.inductor_regions is not None:
        return ctx.config.inductor_regions
    return len({block_of_name(n) for n in ctx.parameter_names} - {""}) >= MIN_BLOCKS


def compiled_whole_reason(gm: fx.GraphModule, ctx: PassContext) -> Optional[str]:
    """Why Inductor compiles gm whole rather than region by region (inductor_regions.py), or None.
    The one place that decides it: the backend compiles by it, and bucket_collectives' rewrite is
    safe only where the collectives stay FX nodes between regions."""
    if not cuts_at_blocks(ctx):
        return "not cut by block (Config.inductor_regions)"
    node = first_symbolic_node(gm)
    return None if node is None else f"{node.name} has a symbolic shape (regions would need their own guards)"


def blocks_of(ctx: PassContext) -> Callable[[fx.Node], Optional[str]]:
    """node -> the block of the parameter a marker (or the collective lowered from it) serves; None
    where the node does not say or the graph is not cut by block (then it may share a bucket with
    any neighbour). Worked out once per graph: bucketing asks for every collective."""
    if not cuts_at_blocks(ctx):
        return lambda node: None
    name_of = parameter_names_of(ctx)
    return lambda node: None if (name := name_of(node)) is None else block_of_name(name)
