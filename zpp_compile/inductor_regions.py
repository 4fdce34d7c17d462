"""Lower a rewritten graph to Inductor one region at a time (Config.inductor_regions, the default).

A region is a run of computation between two collectives. Each one is cut out into a graph of its
own with canonical node names and compiled by Inductor; the graph around the regions (the
collectives, their waits, and runs made only of views) stays FX and calls them in order.

Why: the blocks of a transformer give identical regions (same ops, same shapes), and identical
region graphs have the same FX-graph cache key. Inductor then schedules, tiles and builds one
block's kernels and every other block hits its cache, in the same process: compile time no longer
grows at Inductor's cost per kernel with depth. This is the reuse torch.compile(DDP) gets from its
per-bucket graphs. Nothing is lost to fusion: Inductor cannot fuse across a collective's wait, and
the order of collectives and computation is the one schedule_overlap chose, kept as it is.

Before (a lowered forward graph):
    p0, p1, x = placeholders
    ag0 = all_gather(p0); w0 = wait(ag0); ag1 = all_gather(p1)
    h = addmm(view(w0), x); h = gelu(h); ...                 # layer 0
    w1 = wait(ag1); h = addmm(view(w1), h); ...              # layer 1
After:
    ag0 = all_gather(p0); w0 = wait(ag0); ag1 = all_gather(p1)
    r0 = region([w0, x])       # the compiled kernels of layer 0 (one boxed call)
    w1 = wait(ag1)
    r1 = region([w1, r0[0]])   # layer 1: the same region graph, an FX-graph cache hit

A region takes its inputs as a list that the outer graph holds no other reference to, as the
boxed calling convention means: Inductor's code empties it and frees each input after its last
kernel. (Passed as arguments they lived until the region returned: the backward's first region
held the 147 MB gathered embedding of GPT-2 past its last read and while it made the head's
147 MB gradient.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._inductor import config as inductor_config
from torch.fx.graph import _BoxedCodeGen

from . import rooted_ops, scatter_ops  # noqa: F401 (register the zpp ops named below)
from .passes.graph_utils import is_random

log = logging.getLogger(__name__)

# Everything of these namespaces stays in the outer graph: the functional collectives and waits.
BOUNDARY_NAMESPACES = ("_c10d_functional", "c10d_functional")
# And these: root_large_collectives' collectives and waits (rooted_ops.py), and fold_scatter_grads'
# in-place write into a gradient another region computed (scatter_ops.py; Inductor never
# overwrites a region's input).
BOUNDARY_OPS = (
    torch.ops.zpp.rooted_all_gather.default,
    torch.ops.zpp.rooted_reduce_scatter.default,
    torch.ops.zpp.wait_rooted.default,
    torch.ops.zpp.add_rows.default,
)
# Compiling a run that only re-views tensors buys nothing: it stays FX.
_NOT_COMPUTE = (operator.getitem,)

CompileRegion = Callable[[fx.GraphModule, list[Any]], Callable[[list[Any]], Any]]


@dataclasses.dataclass(frozen=True)
class Region:
    """One run of computation cut out of the outer graph."""

    graph: fx.GraphModule  # canonical node names: identical runs give identical code
    inputs: list[fx.Node]  # outer-graph values it reads, in the order of its placeholders
    outputs: list[fx.Node]  # its values the rest of the outer graph reads, in graph order


def is_boundary(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (
        getattr(target, "namespace", None) in BOUNDARY_NAMESPACES or target in BOUNDARY_OPS
    )


def _is_compute(node: fx.Node) -> bool:
    """A node Inductor would generate a kernel (or call an extern one) for: not a pure view."""
    if node.op != "call_function" or node.target in _NOT_COMPUTE:
        return False
    schema = getattr(node.target, "_schema", None)
    aliasing = schema is not None and not schema.is_mutable and any(r.alias_info for r in schema.returns)
    return not aliasing


def runs_between_collectives(graph: fx.Graph) -> list[list[fx.Node]]:
    """The maximal runs of consecutive nodes with no collective among them (graph order)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or is_boundary(node):
            if current:
                runs.append(current)
            current = []
        else:
            current.append(node)
    if current:
        runs.append(current)
    return runs


def cut_region(gm: fx.GraphModule, run: list[fx.Node]) -> Optional[Region]:
    """The run as a graph of its own, or None where it stays FX (only views, or it reads or
    returns a value that is not a tensor). May take getitems into the run (_take_in_getitems)."""
    if not any(_is_compute(n) for n in run) or not _take_in_getitems(run):
        return None
    members = set(run)
    inputs = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in members))
    if not all(isinstance(i.meta.get("val"), torch.Tensor) for i in inputs):
        return None
    outputs = [n for n in run if any(user not in members for user in n.users)]
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in outputs):
        return None
    root, graph = torch.nn.Module(), fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    constants = 0
    for i, value in enumerate(inputs):
        env[value] = graph.placeholder(f"arg{i}")
        env[value].meta["val"] = value.meta["val"]
    for node in run:
        if node.op == "get_attr":
            name, constants = f"_constant{constants}", constants + 1
            setattr(root, name, _attribute(gm, node.target))
            copied = graph.get_attr(name)
        else:  # no name given: FX numbers nodes by their target, the same in every identical run
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            copied = graph.create_node(node.op, node.target, args, kwargs)
        for key in ("val", "tensor_meta"):
            if key in node.meta:
                copied.meta[key] = node.meta[key]
        env[node] = copied
    graph.output(tuple(env[n] for n in outputs))
    return Region(fx.GraphModule(root, graph), inputs, outputs)


def _take_in_getitems(run: list[fx.Node]) -> bool:
    """A region returns tensors only: the getitems that unpack a multi-output node of the run
    (dropout's output and mask) move from later in the graph to right after it, into the run.
    False where a multi-output node has another kind of user outside the run (the run stays FX)."""
    members = set(run)
    for node in list(run):
        if isinstance(node.meta.get("val"), torch.Tensor):
            continue
        outside = [user for user in node.users if user not in members]
        if not all(user.op == "call_function" and user.target is operator.getitem for user in outside):
            return False
        at = run.index(node) + 1
        for user in outside:
            node.append(user)  # reads only `node`: moving it up keeps the graph valid
            run.insert(at, user)
            members.add(user)
    return True


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _replace_run(gm: fx.GraphModule, run: list[fx.Node], region: Region, call: Callable, index: int) -> None:
    """Put one call of the compiled region where the run was; its outputs replace the run's."""
    graph = gm.graph
    with graph.inserting_before(run[0]):
        # The inputs go in a list the outer graph then lets go of (FX frees a value after its
        # last reader, here the list): Inductor's code empties the list and frees each input
        # after its last kernel, not when the region returns.
        inputs = graph.call_function(inputs_list, tuple(region.inputs))
        node = graph.call_function(call, (inputs,))
        node.name = f"region_{index}"
        results = [graph.call_function(operator.getitem, (node, i)) for i in range(len(region.outputs))]
    for old, new in zip(region.outputs, results):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new)
    for old in reversed(run):
        graph.erase_node(old)


@dataclasses.dataclass(eq=False)
class RegionCompile:
    """One distinct region of a graph to compile; the graph's region calls read `compiled`."""

    digest: Optional[str]  # of its reuse key, equal on every rank with the same region; None: none
    size: int  # its node count: a proxy for how long it takes to compile
    graph: fx.GraphModule
    fake_inputs: list[Any]
    compile_region: CompileRegion
    compiled: Optional[Callable[[list[Any]], Any]] = None

    def compile(self) -> None:
        # A context of its own: Inductor reports each graph's output strides to the tracing
        # context, which AOTAutograd's expects once per forward, not once per region. So regions
        # hand each other tensors in the strides they were traced with: Inductor's layout
        # optimization (channels-last around convolutions) would give a region's outputs others,
        # which AOTAutograd corrects between whole graphs, not between regions.
        with (
            tracing(TracingContext(detect_fake_mode(self.fake_inputs))),
            inductor_config.patch(layout_optimization=False),
        ):
            self.compiled = self.compile_region(self.graph, self.fake_inputs)


def compile_each(jobs: list[RegionCompile]) -> None:
    for job in jobs:
        job.compile()


class WholeGraphCompile(RegionCompile):
    """A graph compiled whole (no regions: see passes.compiled_whole_reason), as one job, so that
    compile_sharing deals it out like a region: the ranks of a host compiling the same graph
    compile it once between them."""

    def compile(self) -> None:
        # In the tracing context AOTAutograd set up: a whole graph's output strides are the ones
        # it expects.
        self.compiled = self.compile_region(self.graph, self.fake_inputs)


def compile_whole(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    compile_graph: CompileRegion,
    compile_all: Callable[[list[RegionCompile]], None] = compile_each,
) -> Callable[[list[Any]], Any]:
    """gm compiled whole by `compile_graph`, through `compile_all` as one job (its digest: the
    graph's code and its inputs' geometry, as a region's)."""
    key = _reuse_key(gm, example_inputs)
    digest = None if key is None else _digest(key, compile_graph)
    job = WholeGraphCompile(digest, len(gm.graph.nodes), gm, example_inputs, compile_graph)
    compile_all([job])
    return job.compiled  # type: ignore[return-value]


def inputs_list(*inputs: Any) -> list[Any]:
    """A region's inputs as the list its boxed callable takes (and empties)."""
    return list(inputs)


def _boxed_region(job: RegionCompile) -> Callable[[list[Any]], Any]:
    def region(inputs: list[Any]) -> Any:
        return job.compiled(inputs)  # type: ignore[misc]

    return region


def sink_input_free_nodes(graph: fx.Graph) -> None:
    """Move what is computed from no value (an iota, a fill, and what follows from them alone) to
    just before its first reader, so that it falls into the reader's region, where Inductor
    computes it inline. Left where a pass put it, above a collective's wait, it went into the
    region before and crossed the cut as a real tensor: full ZeRO++ on GPT-2 passed two int64
    index tensors of the embedding's size (2 x 309 MB) from region to region. Random draws stay
    where they are: moving one would reorder the generator's stream; so do zpp's own ops, which
    may read state another op writes (qgZ's error feedback)."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if (
            node.op == "call_function"
            and node.users
            and not is_boundary(node)
            and not is_random(node)
            and not node.is_impure()
            and getattr(node.target, "namespace", None) != "zpp"  # ef_load reads state ef_store writes
            and all(arg in free for arg in node.all_input_nodes)
        ):
            free.add(node)
    for node in reversed([n for n in graph.nodes if n in free]):  # readers first: they move first
        reader = min(node.users)
        if _is_compute(reader) and not is_boundary(reader):  # a collective's buffer stays put
            reader.prepend(node)


def compile_regions(
    gm: fx.GraphModule,
    compile_region: CompileRegion,
    compile_all: Callable[[list[RegionCompile]], None] = compile_each,
) -> Callable[[list[Any]], Any]:
    """gm with each run between collectives compiled by `compile_region(region_graph, fake_inputs)`
    (a boxed callable), as a boxed callable: it takes the list of inputs and frees each after its
    last use, as Inductor's own compiled graphs do. gm is changed in place.

    A region identical to an earlier one of gm (same code, inputs of the same shapes, strides and
    dtypes, no constants) reuses its compiled callable without asking Inductor again; across graphs
    and processes the FX-graph cache does the same. The graph is cut first; then `compile_all`
    compiles its distinct regions (compile_sharing deals them out among a host's ranks)."""
    sink_input_free_nodes(gm.graph)
    runs = runs_between_collectives(gm.graph)
    jobs: dict[Any, RegionCompile] = {}
    regions = 0
    taken: set[fx.Node] = set()  # getitems an earlier run took in: no longer in their own run
    for index, run in enumerate(runs):
        run[:] = [n for n in run if n not in taken]
        own = set(run)
        region = cut_region(gm, run)
        taken.update(n for n in run if n not in own)
        if region is None:
            continue
        fake_inputs = [i.meta["val"] for i in region.inputs]
        key = _reuse_key(region.graph, fake_inputs)
        if key is None or key not in jobs:
            digest = None if key is None else _digest(key, compile_region)
            size = len(region.graph.graph.nodes)
            jobs[key or index] = RegionCompile(digest, size, region.graph, fake_inputs, compile_region)
        _replace_run(gm, run, region, _boxed_region(jobs[key or index]), index)
        regions += 1
    compile_all(list(jobs.values()))
    log.debug("zpp_compile: %d runs between collectives, %d regions, %d compiled", len(runs), regions, len(jobs))
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run_graph(args: list[Any]) -> Any:
        return gm.forward(args)

    run_graph._boxed_call = True  # type: ignore[attr-defined]
    return run_graph


def _digest(key: tuple, compile_region: CompileRegion) -> str:
    """The reuse key and how the region is compiled (forward or backward: Inductor keys on it),
    hashed: equal on every rank (and process) whose region is the same."""
    how = sorted(getattr(compile_region, "keywords", {}).items())
    return hashlib.sha256(repr((key, how)).encode()).hexdigest()[:32]


def _reuse_key(gm: fx.GraphModule, inputs: list[Any]) -> Optional[tuple]:
    """What makes two graphs' (or regions') compiled code interchangeable: their code and their
    inputs' geometry. None for a graph with constants (their values are not in its code), with
    symbolic sizes, or taking anything but tensors and plain numbers."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    geometry = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            sizes = (*value.shape, *value.stride(), value.storage_offset())
            if not all(isinstance(size, int) for size in sizes):
                return None
            geometry.append((tuple(value.shape), value.stride(), value.dtype, value.device, value.storage_offset()))
        elif type(value) in (int, float, bool):
            geometry.append(value)
        else:
            return None
    return gm.code, tuple(geometry)
