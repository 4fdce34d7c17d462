"""localize_constant_scalars: each reader of a shared constant scalar gets its own copy of it.

Runs on the joint graph, before the partition. Under dynamic shapes Dynamo does not bake a Python
float such as HF GPT-2's `math.sqrt(2.0 / math.pi)` into the ops that use it; the graph computes
it once, from constants, and Inductor's joint passes share that one computation among every layer:
Before:  full = aten.full([], 2.0)                                  # graph order 170
         sqrt = aten.sqrt(aten.div(full, 3.14159...))                # reads no graph input
         c_0 = prims.convert_element_type(sqrt, f32);  inner_0 = aten.mul(add_0, c_0)   # layer 0, 180
         c_1 = prims.convert_element_type(sqrt, f32);  inner_1 = aten.mul(add_1, c_1)   # layer 1, 280
The min-cut partitioner then sees `sqrt` used "far apart" and bans every later layer's `inner_k`
from recomputation, so each of those layers saves one more batch x sequence x 4*hidden activation
for the backward (the GELU's tanh) than the same model with static shapes.
After:   each reader heads a copy of the constant chain, placed right before it:
         full_1 = ...; sqrt_1 = ...; c_1 = prims.convert_element_type(sqrt_1, f32)
         inner_1 = aten.mul(add_1, c_1)
and the original chain is erased once nothing reads it. The copies compute the same ops, so the
values are bitwise the same; Inductor fuses each copy into the kernel that reads it, as it did the
shared one. Only one-element tensors are copied, computed from constants and one-element graph
inputs (Dynamo hands an unspecialized float such as `math.pi` in as one) with no random op; a
chain read once is left alone, so static graphs rarely change.

The partitioner's common-subexpression elimination would merge the copies back into one chain, so
this pass runs that elimination itself first, and the backend partitions with it off
(`partition_without_cse`): the graph the min-cut sees is the one it saw before, less the sharing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse

from .context import PassContext
from .graph_utils import finish, is_random

log = logging.getLogger(__name__)


def localize_constant_scalars(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if functorch_config.cse:  # the partitioner's own elimination, done early: see partition_without_cse
        gm.graph = fx_graph_cse(gm.graph)
    constant = _constant_scalars(gm.graph)
    shared = _shared(constant)
    heads_of = {n: [a for a in n.all_input_nodes if a in shared] for n in gm.graph.nodes if n not in constant}
    heads_of = {reader: heads for reader, heads in heads_of.items() if heads}
    if not heads_of:
        log.debug("localize_constant_scalars: %s shares no constant scalar; only eliminated", ctx.label)
        return finish(gm)
    for reader, heads in heads_of.items():
        _copy_chains_before(reader, heads, constant)
    for node in reversed(constant):
        if not node.users and node.op != "placeholder":
            gm.graph.erase_node(node)
    return finish(gm)


@contextlib.contextmanager
def partition_without_cse() -> Iterator[None]:
    """The min-cut partition as it runs after this pass: its elimination already done here."""
    with functorch_config.patch(cse=False):
        yield


def _constant_scalars(graph: fx.Graph) -> dict[fx.Node, None]:
    """One-element tensors computed from constants and one-element inputs only (no random draw, no
    side effect anywhere up their chain, so computing them twice changes nothing), in graph
    order. The inputs themselves are never copied: `_copy_chains_before` copies call_functions."""
    constant: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if node.op == "placeholder" and _is_scalar_tensor(node):
            constant[node] = None
        elif (
            node.op == "call_function"
            and _is_scalar_tensor(node)
            and not is_random(node)
            and not node.is_impure()
            and all(a in constant for a in node.all_input_nodes)
        ):
            constant[node] = None
    return constant


def _is_scalar_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    # Static sizes only: comparing a symbolic numel would add a guard on the shapes.
    return isinstance(val, torch.Tensor) and all(type(s) is int for s in val.shape) and math.prod(val.shape) == 1


def _shared(constant: dict[fx.Node, None]) -> set[fx.Node]:
    """The heads of shared chains: constant scalars that another node reads, where some node up
    the chain (or the head itself) has more than one user."""
    fanned_out: set[fx.Node] = set()
    for node in constant:  # graph order: a node's chain is decided before it
        if node.op == "placeholder":
            continue  # an input read by several nodes is no shared computation
        if len(node.users) > 1 or any(a in fanned_out for a in node.all_input_nodes):
            fanned_out.add(node)
    return {n for n in fanned_out if any(u not in constant for u in n.users)}


def _copy_chains_before(reader: fx.Node, heads: list[fx.Node], constant: dict[fx.Node, None]) -> None:
    graph = reader.graph
    needed = _chain(heads, constant)
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(reader):
        for node in (n for n in constant if n in needed and n.op != "placeholder"):  # graph order
            copies[node] = graph.node_copy(node, lambda a: copies.get(a, a))
    for head in heads:
        reader.replace_input_with(head, copies[head])


def _chain(heads: list[fx.Node], constant: dict[fx.Node, None]) -> set[fx.Node]:
    """The heads and the constant nodes they are computed from."""
    needed: set[fx.Node] = set()
    stack = list(heads)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(a for a in node.all_input_nodes if a in constant)
    return needed
