"""Small FX helpers shared by the passes: predicates on nodes and meta-preserving insertion."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.fx_passes.post_grad import noop_registry
from torch.utils._pytree import tree_map_only

from ..cost_model import returns_alias
from .trace_cache import cached_trace, copy_fake_values

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# The markers that stand for "the full weight of this parameter", before lowering.
GATHER_MARKERS = (
    torch.ops.zpp.gather_param.default,
    torch.ops.zpp.gather_quantized_param.default,
    torch.ops.zpp.replicated_param.default,
)
# Those that gather from a sharded parameter (hpZ can re-gather them inside the node).
SHARD_GATHERS = GATHER_MARKERS[:2]


# Functional collectives as the lowered graphs issue them, by the name the comm counter and the
# plans give them (Inductor's bucketing writes the _out form of all-gather); each has exactly one
# user, its wait_tensor. The one list of them: plan.py reads it too.
COLLECTIVE_OPS = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_gather_into_tensor_out.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.all_reduce.default: "all_reduce",
    # root_large_collectives' unstaged forms on gloo (rooted_ops.py); each has one user, wait_rooted.
    torch.ops.zpp.rooted_all_gather.default: "all_gather",
    torch.ops.zpp.rooted_reduce_scatter.default: "reduce_scatter",
}
COLLECTIVE_STARTS = tuple(COLLECTIVE_OPS)


def is_call(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def calls(graph: fx.Graph, *targets: Any) -> Iterator[fx.Node]:
    """Nodes calling any of `targets`, in graph order (a snapshot: safe to rewrite while iterating)."""
    return iter([n for n in graph.nodes if is_call(n, *targets)])


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that depend on a tangent: its backward."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in backward for a in node.all_input_nodes
        ):
            backward.add(node)
    return backward


def has_static_geometry(t: torch.Tensor) -> bool:
    """Whether a tensor's sizes (and, strided, its strides and offset) are plain ints, no SymInt
    (dynamic shapes; reading a symbolic one would add guards)."""
    dims = (*t.shape, *t.stride(), t.storage_offset()) if t.layout == torch.strided else tuple(t.shape)
    return all(type(d) is int for d in dims)


def first_symbolic_node(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The first node whose value is a SymInt or a tensor with symbolic geometry (dynamic shapes)."""
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not has_static_geometry(v)):
            return node
    return None


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    return first_symbolic_node(gm) is not None


def is_view_or_cast(node: fx.Node) -> bool:
    """True for ops that only re-view or re-type one tensor (aliasing returns, dtype casts)."""
    if node.op != "call_function":
        return False
    if node.target in (torch.ops.prims.convert_element_type.default, aten._to_copy.default, aten.clone.default):
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return len(schema.returns) == 1 and schema.returns[0].alias_info is not None


# Ops whose result is kept in their first input's storage though their schema marks no alias: a
# functional collective's wait returns the tensor its collective wrote; `_unsafe_view` is a view.
_UNMARKED_VIEWS = (c10d.wait_tensor.default, aten._unsafe_view.default)


def shares_input_storage(node: fx.Node) -> bool:
    """Whether `node`'s result lives in its first input's storage (a view or a wait), so that
    memory is freed only after `node`'s readers are done too."""
    return node.op == "call_function" and (node.target in _UNMARKED_VIEWS or returns_alias(node))


def is_fresh_buffer(node: fx.Node) -> bool:
    """Whether `node` is a tensor of its own that a later op may write into: an op returns it new
    (its schema marks no alias) and Inductor never replaces the op by its input (post_grad's
    no-op table: a clone, a one-part cat or a zero pad dropped after the pass would make the write
    land in the tensor they copied; `_unsafe_view`, a view its schema does not mark)."""
    return (
        node.op == "call_function"
        and hasattr(node.target, "_schema")
        and not returns_alias(node)
        and node.target not in _NOT_FRESH
    )


_NOT_FRESH = (*noop_registry, aten._unsafe_view.default)


def graph_input_of(node: fx.Node) -> fx.Node:
    """The graph input a parameter read takes: the node itself, or the DTensor input whose
    to_local() it is (Dynamo's graphs)."""
    if node.op == "call_method" and node.target == "to_local":
        return node.args[0]
    return node


def tensor_val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def insert_call(graph: fx.Graph, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
    """Insert `target(*args)` at the graph's insertion point with a valid meta["val"].

    The value is computed by running `target` on the fake values of the argument nodes, so later
    passes, the partitioner and Inductor see correct shapes, dtypes and strides.
    """
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
    fake_mode = detect_fake_mode(fake_args)
    if fake_mode is None:
        raise RuntimeError(f"insert_call({target}): argument nodes carry no fake values in meta['val'].")
    with fake_mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def flatten_padded(graph: fx.Graph, tensor: fx.Node, target_numel: int) -> fx.Node:
    """`tensor` as a contiguous 1-D tensor (copied only if it is strided), zero-padded to target_numel."""
    if not tensor.meta["val"].is_contiguous():
        tensor = insert_call(graph, aten.clone.default, tensor, memory_format=torch.contiguous_format)
    flat = tensor if tensor.meta["val"].dim() == 1 else insert_call(graph, aten.view.default, tensor, [-1])
    pad = target_numel - flat.meta["val"].numel()
    if pad:
        flat = insert_call(graph, aten.constant_pad_nd.default, flat, [0, pad])
    return flat


def zero_pad_at_end(node: fx.Node) -> Optional[int]:
    """p where `node` is constant_pad_nd(x, [0, p]) with value 0 (what flatten_padded builds), else None."""
    if not is_call(node, aten.constant_pad_nd.default) or len(node.args[1]) != 2 or node.args[1][0] != 0:
        return None
    pad = node.args[1][1]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return pad if type(pad) is int and pad >= 0 and value == 0 else None


def is_random(node: fx.Node) -> bool:
    """A node drawing from a random generator (rand, randn, bernoulli, dropout, randperm, ...)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def random_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_random(n)]


def stable_topological_sort(graph: fx.Graph, draw_order: list[fx.Node]) -> None:
    """Order the graph so that every node follows its inputs, moving as little as possible, and
    the random nodes of `draw_order` (the random nodes as they were before a pass moved things)
    draw in that order. Random ops share one generator: two of them swapped draw each other's
    values, so a compiled step would no longer draw the masks the eager step does. (Inductor's
    own stable sort knows data dependencies only.)"""
    follows = dict(zip(draw_order[1:], draw_order[:-1]))
    placed: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}
    order: list[fx.Node] = []

    def missing(node: fx.Node):
        inputs = [*node.all_input_nodes, *([follows[node]] if node in follows else [])]
        return next((i for i in inputs if i not in placed), None)

    def place(node: fx.Node) -> None:
        stack = [node]
        while stack:
            current = stack.pop()
            blocker = missing(current)
            if blocker is not None:
                waiting.setdefault(blocker, []).append(current)
                continue
            placed.add(current)
            order.append(current)
            stack.extend(reversed(waiting.pop(current, [])))

    output = graph.output_node()
    for node in list(graph.nodes):
        if node is not output:
            place(node)
    if len(order) != len(graph.nodes) - 1:
        raise RuntimeError("stable_topological_sort: the graph has a cycle")
    for node in [*order, output]:
        graph._root.prepend(node)  # to the end: the nodes end up in `order`


def replace_node(old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Check the rewritten graph, and regenerate gm's code unless a pipeline will do it once at its
    end (recompiling a model-sized graph after every pass cost seconds per compile)."""
    gm.graph.lint()
    if not _recompile_deferred.get():
        gm.recompile()
    return gm


_recompile_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("zpp_recompile_deferred", default=False)


@contextlib.contextmanager
def deferred_recompile() -> Iterator[None]:
    """Inside, finish() leaves gm's code stale: the pipeline recompiles once at its end.
    (gm.print_readable, which the graph dumps use, reads the graph, not the code.)"""
    token = _recompile_deferred.set(True)
    try:
        yield
    finally:
        _recompile_deferred.reset(token)


def rewrite_calls(
    gm: fx.GraphModule,
    target: Any,
    rewrite: Callable[[fx.Graph, fx.Node], fx.Node],
    pass_name: str,
    label: str,
    where: Callable[[fx.Node], bool] = lambda node: True,
) -> fx.GraphModule:
    """Replace every call of `target` (for which `where` holds) by the subgraph `rewrite(graph, node)`
    builds in its place.

    Returns `gm` untouched (and says so at debug level) when there is no such call.
    """
    nodes = [node for node in calls(gm.graph, target) if where(node)]
    if not nodes:
        logging.getLogger(__name__).debug("%s: %s has no %s; graph unchanged", pass_name, label, target)
        return gm
    for node in nodes:
        before = node.prev
        with gm.graph.inserting_before(node):
            replacement = rewrite(gm.graph, node)
        tag_collectives(before, node, node.meta.get("custom"))
        replace_node(node, replacement)
    return finish(gm)


def tag_collectives(start: fx.Node, stop: fx.Node, custom: dict | None) -> None:
    """The collectives a rewrite inserted strictly between `start` and `stop` carry `custom`, the
    meta["custom"] of the marker they replace: which parameter they serve. Bucketing keeps blocks
    apart by it, so an untagged gather is a bucket of its own (tests/passes/test_hpz.py)."""
    node = start.next
    while custom and node is not stop:
        if is_call(node, *COLLECTIVE_STARTS):
            node.meta.setdefault("custom", {}).update(custom)
        node = node.next


def inline_traced(graph: fx.Graph, fn: Callable, node_args: list[fx.Node], decompositions: dict | None = None) -> Any:
    """Trace `fn(*node_args' fake values)` to ATen and copy its nodes in at the insertion point.

    Lets a pass write a rewrite as plain torch code (see codegen/quantize.py) instead of node by
    node; the copied nodes carry valid meta["val"]. Returns the node(s) of fn's output.
    Traced functionalized, as AOTAutograd would: a torch.library.triton_op then becomes
    triton_kernel_wrapper_functional, the form Inductor schedules as a user Triton kernel.

    A trace is reused for the same `fn` (a functools.partial compared by its arguments) on inputs
    of the same shapes (trace_cache.py: within the compile, and across processes through the
    cache folder): the parameters of repeated blocks trace once, and each copy gets fake values
    of its own (passes and Inductor tell tensors apart by them).
    """
    fake_args = [n.meta["val"] for n in node_args]
    fake_mode = detect_fake_mode(fake_args)
    traced, reused = cached_trace(
        fn, fake_args, fake_mode, decompositions, lambda: _trace(fn, fake_args, fake_mode, decompositions).graph
    )
    placeholders = [n for n in traced.nodes if n.op == "placeholder"]
    copied: dict[fx.Node, fx.Node] = dict(zip(placeholders, node_args))
    out = graph.graph_copy(traced, copied)
    if reused:
        copy_fake_values(list(traced.nodes), copied, fake_mode)
    return out


def _trace(fn: Callable, fake_args: list, fake_mode: Any, decompositions: dict | None) -> fx.GraphModule:
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        return make_fx(dispatch_functionalize(fn), decomposition_table=decompositions or {})(*fake_args)
