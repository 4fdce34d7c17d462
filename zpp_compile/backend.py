"""The "zeropp" torch.compile backend: Dynamo graph -> passes -> AOTAutograd -> passes -> Inductor.

Dynamo graph (zpp.gather_param markers on parameter shards)
  -> PRE_AUTOGRAD_PASSES                       (dedupe gathers of one parameter)
  -> AOTAutograd joint graph (gather_param's autograd adds zpp.reduce_grad markers)
  -> JOINT_PASSES, min-cut partition           (gathered weights are recomputed, not saved)
  -> PARTITION_PASSES on forward + backward    (hpZ: save secondary shards, gather in-node)
  -> FORWARD_PASSES / BACKWARD_PASSES           (markers -> functional collectives)
  -> Inductor compile_fx_inner, or the FX graph itself with Config(lowering="aot_eager")
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.metadata
import itertools
import logging
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx._lazy_graph_module import _LazyGraphModule

from . import (
    aot_cache,
    auto_plan,
    comm,
    compat,
    compile_sharing,
    compile_timing,
    inductor_regions,
    passes,
    undefined_tangents,
)
from .faults import explained_collective_failures
from .layout import ShardedState, shard_spec, state_of_shard
from .passes.buckets import blocks_of
from .plan import as_scheduled, collectives_in, marker_schedule
from .plan_trial import PlanTrial
from .process_state import register_reset
from .schedule_check import CHECKED_RUNS, Schedule, current_parameter_names, maybe_check, parameter_names
from .topology import require_initialized

log = logging.getLogger(__name__)

BACKEND_NAME = "zeropp"
_graph_ids = itertools.count()
# Warn (once per model) when one of its frames has this many compiles left before Dynamo's
# recompile_limit: by then it recompiles far more often than train/eval or a last short batch.
RECOMPILE_STORM_MARGIN = 2


class RecompileStormWarning(UserWarning):
    pass


class NotShardedError(RuntimeError):
    pass


@dataclasses.dataclass
class GraphRecord:
    """What the backend made of one Dynamo graph; kept for inspection and tests."""

    graph_id: int
    forward: Optional[fx.GraphModule] = None
    backward: Optional[fx.GraphModule] = None
    saved_for_backward: list[torch.Tensor] = dataclasses.field(default_factory=list)
    collectives: dict[str, list[comm.Collective]] = dataclasses.field(default_factory=dict)
    # Compile seconds per stage ("forward/qwz", "backward/inductor", "aot_autograd", ...): see
    # zpp_compile.compile_timing.
    compile_seconds: compile_timing.StageSeconds = dataclasses.field(default_factory=compile_timing.StageSeconds)
    # Per phase ("forward", "backward", "inference"), what Inductor's FX-graph cache did: "hit",
    # "miss", "bypass" (uncacheable), "off" (caches disabled), or counts when its regions differed
    # ("9 hit, 3 miss"); empty under lowering="aot_eager".
    inductor_cache: dict[str, str] = dataclasses.field(default_factory=dict)
    # Config(plan="auto"): the plan chosen for this graph (auto_plan.AutoPlan); None otherwise.
    auto_plan: Optional[Any] = None
    # What AOTAutograd's cache did for the graph (aot_cache.py): "hit" (no pass ran: the rewritten
    # graphs were loaded), "miss", "bypass: <why>" (not looked up), "miss, not kept: <why>", or
    # counts when a load failed and the graph was compiled again ("1 miss, 1 bypass").
    aot_cache: str = ""
    # The backward as it runs: lowered per set of tangents its calls left undefined (see
    # undefined_tangents); `backward` above is the graph with every tangent.
    backward_variants: Optional[undefined_tangents.TangentVariants] = None


_RECORDS: dict[int, GraphRecord] = {}


def compiled_graphs() -> list[GraphRecord]:
    """Records of the graphs this process compiled with the zeropp backend, oldest first."""
    return [_RECORDS[k] for k in sorted(_RECORDS)]


@register_reset
def clear_compiled_graphs() -> None:
    _RECORDS.clear()


def zeropp_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
    """torch.compile backend entry: compile one Dynamo graph of a model sharded by zpp_compile.shard."""
    require_initialized("torch.compile(backend='zeropp')")
    compat.check_lazy_private_apis()
    state = _sharded_state_of(gm, example_inputs)
    if state is None:
        # A graph without parameters (e.g. after a graph break): nothing to shard in it.
        log.debug("zeropp: graph has no parameter shards; compiling it unchanged")
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    _report_recompile_storm(state)
    param_positions = [i for i, v in enumerate(example_inputs) if shard_spec(v) is not None]
    decompositions = _inductor_decompositions() if state.config.lowering == "inductor" else {}
    ctx = passes.PassContext(
        config=state.config, topology=state.topology, graph_id=next(_graph_ids), decompositions=decompositions,
        cost_model=state.cost_model, plan_id=state.plan_id,
        parameter_names=tuple(shard_spec(example_inputs[i]).fqn for i in param_positions),
        parameter_positions=tuple(param_positions),
    )  # fmt: skip
    _RECORDS[ctx.graph_id] = GraphRecord(ctx.graph_id, compile_seconds=ctx.stage_seconds)
    # Exclusive timing: what the stages inside do not account for is AOTAutograd's own work.
    with ctx.stage_seconds.timed(compile_timing.AOT_TRACE):
        gm = passes.run_passes(gm, ctx.for_phase("dynamo"), passes.PRE_AUTOGRAD_PASSES)
        compiled = _aot_autograd(gm, example_inputs, ctx=ctx, state=state)
    record = _RECORDS[ctx.graph_id]
    compile_timing.log_graph(f"graph{ctx.graph_id}", ctx.stage_seconds, record.aot_cache)
    if record.auto_plan is not None and len(record.auto_plan.candidates) > 1:
        compiled = _plan_trial(gm, example_inputs, ctx, state, record.auto_plan, compiled)
    compiled = undefined_tangents.leaving_undefined(compiled)
    return _naming_parameters(compiled, param_positions)


def _plan_trial(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    ctx: passes.PassContext,
    state: ShardedState,
    plan: Any,
    compiled: Callable,
) -> Callable:
    """Config.plan_trial_steps: the graph compiled for each other candidate of its plan (each a graph
    record of its own), behind a PlanTrial that times them and keeps the fastest."""
    plans, functions = [plan], [compiled]
    for option in plan.candidates[1:]:
        candidate = dataclasses.replace(  # the Config and Topology before the plan replaced them
            ctx,
            config=state.config,
            topology=state.topology,
            graph_id=next(_graph_ids),
            plan_option=option,
            stage_seconds=compile_timing.StageSeconds(),
        )
        _RECORDS[candidate.graph_id] = GraphRecord(candidate.graph_id, compile_seconds=candidate.stage_seconds)
        with candidate.stage_seconds.timed(compile_timing.AOT_TRACE):
            functions.append(_aot_autograd(gm, example_inputs, ctx=candidate, state=state))
        record = _RECORDS[candidate.graph_id]
        compile_timing.log_graph(f"graph{candidate.graph_id} (trial of graph{ctx.graph_id})",
                                 candidate.stage_seconds, record.aot_cache)  # fmt: skip
        plans.append(record.auto_plan)
    device = next(v.device for v in example_inputs if shard_spec(v) is not None)
    return PlanTrial(plans, functions, state, device)


def _aot_autograd(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    ctx: passes.PassContext,
    state: ShardedState,
) -> Callable:
    """AOTAutograd with zeropp's partition and compilers, through AOTAutograd's cache where the
    Config allows (aot_cache.py: a warm start loads the rewritten graphs instead of tracing)."""
    # The compilers take the phase's context when they run: Config(plan="auto") settings are
    # chosen on the joint (or inference) graph, after this point.
    compile_graph = functools.partial(_compile_partitioned, ctx=ctx, state=state)
    compilers = {
        f"{name}_compiler": functools.partial(compile_graph, phase=phase)
        for name, phase in (("fw", "forward"), ("bw", "backward"), ("inference", "inference"))
    }  # fmt: skip
    bypass = aot_cache.bypass_reason(state.config)
    caching: Any = contextlib.nullcontext()
    if bypass is None:
        compilers = {
            name: SerializableAOTDispatchCompiler(aot_cache.ZeroppOutputCode, fn) for name, fn in compilers.items()
        }
        specs = [shard_spec(example_inputs[i]) for i in ctx.parameter_positions]
        tag = aot_cache.key_tag(state.config, state.topology, specs, state.cost_model)
        caching = aot_cache.caching(tag, functools.partial(_lower, ctx=ctx))
    before = compile_timing.aot_autograd_cache_counts()
    with caching:
        compiled = aot_autograd(
            **compilers,
            partition_fn=functools.partial(_partition, ctx=ctx, state=state),
            decompositions=ctx.decompositions,
        )(gm, example_inputs)
    record = _RECORDS[ctx.graph_id]
    record.aot_cache = _aot_cache_outcome(record, before, bypass)
    return compiled


def _aot_cache_outcome(record: GraphRecord, before: tuple[int, int, int], bypass: Optional[str]) -> str:
    """What AOTAutograd's cache did for a graph, in GraphRecord.aot_cache's words."""
    if bypass is not None:
        return f"bypass: {bypass}"
    if record.aot_cache:  # _lower said already: "miss, not kept: <why>"
        return record.aot_cache
    return compile_timing.cache_outcome(before, compile_timing.aot_autograd_cache_counts())


def _naming_parameters(compiled: Callable, positions: list[int]) -> Callable:
    """Each call tells the schedule check which parameters the graph runs on (while runs are
    still checked): a graph Dynamo reuses for several modules runs on other ones each time."""

    @functools.wraps(compiled)
    def call(*args: Any) -> Any:
        if not CHECKED_RUNS.pending():
            return compiled(*args)
        with parameter_names({i: shard_spec(args[i]).fqn for i in positions}):
            return compiled(*args)

    return call


def _report_recompile_storm(state: ShardedState) -> None:
    """Warn once per model when one of its Dynamo frames nears torch._dynamo.config.recompile_limit.

    The limit counts compiles of a code object (a forward method), whatever the cause: shapes,
    train/eval, grad mode, and every model of the same class (each shard() call gets graphs of its
    own, by design: see sharding.gather_full). Each recompile costs a full compile, and past the
    limit Dynamo runs the frame eagerly: the eager path issues other collectives than the compiled
    one, so ranks that fall back at different steps (their shapes differ) stop matching.
    """
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or state.recompile_storm_reported:
        return
    compiles = (compile_id.frame_compile_id or 0) + 1
    limit = torch._dynamo.config.recompile_limit
    if compiles < max(2, limit - RECOMPILE_STORM_MARGIN):
        return
    state.recompile_storm_reported = True
    warnings.warn(
        f"zpp_compile: a frame of this sharded model is being compiled for the {compiles}th time "
        f"(recompile storm); torch._dynamo.config.recompile_limit={limit}. Compiles of every model "
        "of the same class count, as do train/eval and no_grad switches. Each compile takes as long "
        "as the first, and past the limit Dynamo runs the frame eagerly, whose collectives differ "
        "from the compiled graph's: if ranks reach the limit at different steps they stop matching "
        "(a CollectiveError after the timeout, at worst mixed data). Set "
        "torch._dynamo.config.fail_on_recompile_limit_hit = True to stop instead. Run with "
        "TORCH_LOGS=recompiles to see which guard fails; the usual causes are input shapes that change "
        "every step (pad them to a few sizes, or torch._dynamo.mark_dynamic) and Python values that "
        "change (step counters, flags) read inside the model. Reported once per model.",
        RecompileStormWarning,
        stacklevel=1,
    )


def _sharded_state_of(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[ShardedState]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    states = []
    for node, value in zip(placeholders, example_inputs):
        if shard_spec(value) is not None:
            states.append(state_of_shard(value))
            continue
        if isinstance(value, nn.Parameter):
            raise NotShardedError(
                f"torch.compile(backend='zeropp') got an unsharded parameter ({node.name}, shape "
                f"{tuple(value.shape)}): call zpp_compile.shard(model, zpp_compile.Config()) before "
                "torch.compile, and add no parameters to the model after shard()."
            )
    if any(s is not states[0] for s in states):
        raise NotShardedError("one compiled graph mixes parameters of differently sharded models; compile them apart.")
    return states[0] if states else None


def _partition(
    joint_gm: fx.GraphModule, joint_inputs: Any, *, ctx: passes.PassContext, state: ShardedState, **kwargs: Any
):
    """Under Inductor, its own joint-graph passes run first (as torch.compile's default partition
    does: pattern rewrites, and what random ops need), then ours and the partition."""
    partition = functools.partial(_partition_sharded, ctx=ctx, state=state)
    if ctx.config.lowering != "inductor":
        return partition(joint_gm, joint_inputs, **kwargs)
    from torch._inductor.compile_fx import partition_fn

    # Exclusive timing: this stage is Inductor's joint-graph passes, the ones inside are ours.
    with eager_random_ops(), ctx.stage_seconds.timed("joint/inductor_joint_passes"):
        return partition_fn(joint_gm, joint_inputs, partitioner_fn_override=partition, **kwargs)


def eager_random_ops():
    """Random ops in zeropp graphs draw from the default generator exactly as eager PyTorch does
    (Inductor calls the ATen kernels instead of its own philox rewrite): a compiled step with
    dropout consumes the RNG, and draws the masks, the eager sharded model would, so
    torch.manual_seed makes runs repeatable and the eager path stays the compiled one's reference."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def _partition_sharded(
    joint_gm: fx.GraphModule, joint_inputs: Any, *, ctx: passes.PassContext, state: ShardedState, **kwargs: Any
):
    _apply_auto_plan(ctx, state, joint_gm, training=True)
    joint_ctx = ctx.for_phase("joint")
    joint_passes = passes.JOINT_PASSES
    if ctx.config.save_gathered_weights:  # keep the gathered weights: no recompute tags
        joint_passes = [p for p in joint_passes if p is not passes.tag_gathers_for_recompute]
    joint_gm = passes.run_passes(joint_gm, joint_ctx, joint_passes)
    with ctx.stage_seconds.timed("joint/min_cut_partition"), passes.partition_without_cse():
        fw_gm, bw_gm = min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)
    with ctx.stage_seconds.timed("joint/check_no_gathered_weight_saved"):
        passes.check_no_gathered_weight_saved(fw_gm, bw_gm, joint_ctx)
    return passes.run_partition_passes(fw_gm, bw_gm, ctx.for_phase("partitioned"))


def _apply_auto_plan(ctx: passes.PassContext, state: ShardedState, gm: fx.GraphModule, *, training: bool) -> None:
    """Config(plan="auto"): choose this graph's plan once, from the joint graph (or the inference
    graph), and hand every later pass of the graph the manual Config it stands for."""
    if not ctx.config.auto_plan:
        return
    with ctx.stage_seconds.timed("auto_plan"):
        plan = auto_plan.choose_plan(
            gm, state, f"graph{ctx.graph_id}", training=training, block=blocks_of(ctx),
            key=(ctx.parameter_names, training),
            kept=frozenset(passes.kept_for_backward(gm.graph, ctx)) if training else frozenset(),
            option=ctx.plan_option, name_of=passes.parameter_names_of(ctx),
        )  # fmt: skip
    if ctx.plan_option is None:  # a trial's other candidates stand in for this plan (plan_trial.settled)
        state.auto_plans.append(plan)
    _RECORDS[ctx.graph_id].auto_plan = plan
    ctx.config = plan.config
    ctx.topology = auto_plan.topology_for(plan.config, ctx.topology)


def _compile_partitioned(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    ctx: passes.PassContext,
    state: ShardedState,
    phase: str,
) -> Callable:
    _apply_auto_plan(ctx, state, gm, training=False)  # an inference graph: no joint graph before it
    ctx = ctx.for_phase(phase)
    is_backward = ctx.phase == "backward"
    with ctx.stage_seconds.timed(f"{ctx.phase}/schedule_record"):
        markers = marker_schedule(gm, named=not is_backward)
    gm = passes.run_passes(gm, ctx, passes.BACKWARD_PASSES if is_backward else passes.FORWARD_PASSES)
    record = _RECORDS[ctx.graph_id]
    if record.auto_plan is not None:
        record.auto_plan.note_compiled(ctx.phase, gm, ctx.topology.hpz_group_name)
    rewritten = aot_cache.RewrittenPhase.of(ctx.phase, gm, markers, example_inputs)
    return aot_cache.output_code(rewritten, _lower(rewritten, example_inputs, ctx=ctx))


def _lower(rewritten: aot_cache.RewrittenPhase, example_inputs: Sequence[Any], *, ctx: passes.PassContext) -> Callable:
    """A rewritten phase as it runs: Inductor's (or the FX graph's own) code, counting its
    collectives and checking its schedule. Also what a warm start does with a cached phase."""
    ctx = ctx.for_phase(rewritten.phase)
    gm = rewritten.gm
    direction = "backward" if ctx.phase == "backward" else "forward"  # an inference graph runs forward
    with ctx.stage_seconds.timed(f"{ctx.phase}/schedule_record"):
        collectives = collectives_in(gm, direction, ctx.label)
        schedule = Schedule(ctx.label, (*rewritten.markers, *map(as_scheduled, collectives)))
    record = _RECORDS[ctx.graph_id]
    setattr(record, direction, gm)
    record.collectives[ctx.phase] = collectives
    if ctx.phase == "backward":
        record.saved_for_backward = _saved_for_backward(gm)
    if rewritten.unkept is not None:
        record.aot_cache = f"miss, not kept: {rewritten.unkept}"
    lower = functools.partial(_lowered_graph, ctx=ctx, record=record)
    if ctx.phase == "backward":
        # Lowered when it runs, once per set of tangents the call leaves undefined.
        compiled = record.backward_variants = undefined_tangents.TangentVariants(gm, example_inputs, lower)
    else:
        compiled = lower(gm, example_inputs)
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    return _counting(compiled, collectives, schedule, device, ctx)


def _lowered_graph(
    gm: fx.GraphModule, example_inputs: list[Any], *, ctx: passes.PassContext, record: GraphRecord
) -> Callable:
    """One phase graph lowered: by Inductor (region by region), or the FX graph's own code."""
    if ctx.config.lowering == "inductor":
        lowered, lowered_inputs, moved = _opaque_inputs_outside(gm, example_inputs)
        cache_before = compile_timing.fx_graph_cache_counts()
        with eager_random_ops(), aot_cache.inductor_own_settings(), ctx.stage_seconds.timed(f"{ctx.phase}/inductor"):
            compiled = _inductor(lowered, lowered_inputs, ctx, is_copy=moved is not None)
        compiled = _with_opaque_inputs(compiled, moved)
        record.inductor_cache[ctx.phase] = compile_timing.cache_outcome(
            cache_before, compile_timing.fx_graph_cache_counts()
        )
    else:
        compiled = make_boxed_func(gm.forward)
    compile_timing.log_phase(ctx.label, ctx.stage_seconds, ctx.phase, record.inductor_cache.get(ctx.phase))
    return compiled


def _saved_for_backward(bw_gm: fx.GraphModule) -> list[torch.Tensor]:
    """What the forward saves for the backward: its tensors only (DTensor inputs also hand their
    mesh, an opaque object, to the backward)."""
    saved = [p for p in bw_gm.graph.nodes if p.op == "placeholder" and not p.name.startswith("tangents")]
    return [p.meta["val"] for p in saved if isinstance(p.meta.get("val"), torch.Tensor)]


def _inductor(gm: fx.GraphModule, example_inputs: list[Any], ctx: passes.PassContext, *, is_copy: bool) -> Callable:
    """Inductor's compiled gm (boxed): region by region (see inductor_regions) unless the Config
    or the graph rules that out, else whole. `is_copy`: gm is not the graph compiled_graphs()
    keeps, so cutting regions may change it in place."""
    compile_graph = functools.partial(
        _compile_batched if ctx.config.batch_cpu_kernels else _compile_unbatched,
        is_backward=ctx.phase == "backward", is_inference=ctx.phase == "inference", graph_id=ctx.graph_id,
    )  # fmt: skip
    whole = passes.compiled_whole_reason(gm, ctx)
    if whole:
        log.debug("zeropp: %s compiles whole: %s", ctx.label, whole)
        return inductor_regions.compile_whole(gm, list(example_inputs), compile_graph, _job_compiler(ctx))
    # compiled_graphs() keeps the rewritten graph as the passes left it.
    cut = gm if is_copy else fx.GraphModule(gm, copy.deepcopy(gm.graph))
    return inductor_regions.compile_regions(cut, compile_graph, _job_compiler(ctx))


def _compile_batched(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
    """_compile_unbatched with the compiled module's C++ kernels built as one library
    (Config.batch_cpu_kernels)."""
    from . import cpu_kernel_batching  # imports Inductor's code cache: only once the backend compiles

    with cpu_kernel_batching.batched():
        return _compile_unbatched(gm, example_inputs, **kwargs)


def _compile_unbatched(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
    """Inductor's compile_fx_inner, its C++ code generation asking sympy less (cpp_index_strides:
    the same kernels)."""
    from torch._inductor.compile_fx import compile_fx_inner

    from . import cpp_index_strides  # imports Inductor's C++ code generation: only once the backend compiles

    with cpp_index_strides.plain_strides(), aot_cache.tagged_with_code():
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _job_compiler(ctx: passes.PassContext) -> Callable[[list[inductor_regions.RegionCompile]], None]:
    """How a graph's compile jobs (its distinct regions, or the graph whole) get compiled: shared
    with the other ranks of the host (Config.share_compiles), or each by this rank."""
    if not ctx.config.share_compiles:
        return inductor_regions.compile_each
    return functools.partial(compile_sharing.run_compiles, timeout_s=ctx.topology.collective_timeout_s)


@dataclasses.dataclass(frozen=True)
class _OpaqueInputs:
    """Which inputs of a graph stay outside its Inductor compile, and how they come back."""

    kept: list[int]  # positions of the inputs the compiled graph takes
    passed_through: list[tuple[int, int]]  # (output position, input position) returned as is


def _opaque_inputs_outside(
    gm: fx.GraphModule, example_inputs: Sequence[Any]
) -> tuple[fx.GraphModule, list[Any], Optional[_OpaqueInputs]]:
    """A copy of gm without its opaque inputs (not tensors, not numbers: the device meshes
    AOTAutograd passes along with DTensor parameters) that no node reads or that only the output
    returns as they are. Inductor's FX-graph cache hashes such objects anew in every process, so a
    graph taking them never hits the cache in a restarted job; the wrapper (_with_opaque_inputs)
    puts them back. Returns the copy, its example inputs and what was moved (None: nothing, gm).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = gm.graph.output_node().args[0]
    flat_output = isinstance(outputs, (tuple, list))
    moved = {
        i for i, (node, value) in enumerate(zip(placeholders, example_inputs))
        if not isinstance(value, (torch.Tensor, torch.SymInt, int, float, bool))
        and all(user.op == "output" for user in node.users) and (flat_output or not node.users)
    }  # fmt: skip
    if not moved:
        return gm, list(example_inputs), None
    position = {placeholders[i]: i for i in moved}
    passed_through = [(j, position[v]) for j, v in enumerate(outputs) if v in position] if flat_output else []
    graph = copy.deepcopy(gm.graph)
    output = graph.output_node()
    new_placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if passed_through:
        returned = list(output.args[0])
        for j, _ in passed_through:
            returned[j] = None
        output.args = (type(output.args[0])(returned),)
    for i in moved:
        graph.erase_node(new_placeholders[i])
    lowered = _LazyGraphModule(gm, graph)  # its code is made if Inductor reads it (not when cut into regions)
    kept = [i for i in range(len(example_inputs)) if i not in moved]
    return lowered, [example_inputs[i] for i in kept], _OpaqueInputs(kept, passed_through)


def _with_opaque_inputs(compiled: Callable, moved: Optional[_OpaqueInputs]) -> Callable:
    """Call a boxed `compiled` on the inputs it kept and return the moved ones where gm did."""
    if moved is None:
        return compiled

    def call(args: list[Any]) -> Any:
        inputs = [args[i] for i in moved.kept]
        returned = {j: args[i] for j, i in moved.passed_through}
        args.clear()  # the boxed convention: the callee owns (and frees) its inputs
        out = compiled(inputs)
        if not returned:
            return out
        filled = list(out)
        for j, value in returned.items():
            filled[j] = value
        return type(out)(filled)

    call._boxed_call = True
    return call


def _counting(
    compiled: Callable,
    collectives: list[comm.Collective],
    schedule: Schedule,
    device: torch.device,
    ctx: passes.PassContext,
) -> Callable:
    """Wrap a boxed compiled graph so each run adds its collectives to the communication counter,
    and, on the checked runs (Config.check_schedule), compares its schedule across ranks first."""
    counter, topology = comm.comm_counter(), ctx.topology

    def run(args: list[Any]) -> Any:
        with explained_collective_failures(
            f"compiled graph {ctx.graph_id} ({ctx.phase})", topology.collective_timeout_s
        ):
            if schedule.entries:
                maybe_check(schedule.named(current_parameter_names()), topology.world_group_name, device)
            out = compiled(args)
        counter.record(collectives, topology)
        return out

    run._boxed_call = True
    return run


@functools.cache
def _inductor_decompositions() -> dict:
    """Inductor's decompositions, without those of random ops (dropout, bernoulli): they would
    draw with rand() what the eager kernels draw otherwise (see eager_random_ops)."""
    from torch._inductor.decomposition import select_decomp_table

    with eager_random_ops():
        return select_decomp_table()


def register() -> None:
    """Make backend="zeropp" resolvable; torch loads it through the entry point when installed."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if BACKEND_NAME in importlib.metadata.entry_points(group="torch_dynamo_backends").names:
        return  # torch registers it on first lookup via the torch_dynamo_backends entry point
    registry.register_backend(compiler_fn=zeropp_backend, name=BACKEND_NAME)
