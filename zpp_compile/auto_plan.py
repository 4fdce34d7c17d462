"""Config(plan="auto"): each compiled graph's communication plan, chosen by the cost model.

The backend calls choose_plan() once per graph, on the joint forward+backward graph (or the
inference graph), before any pass reads the Config. It reads off the graph what the plan decides
about: each gathered parameter (shard size, dtype on the wire, whether its gradient is reduced)
and the compute (the cost model's FLOPs of every node). For every option -- a set of ZeRO++
techniques x a bucket cap x a prefetch depth -- it estimates the step time and the memory
(estimate()); the fastest option within the memory budget wins, and among options within
TIE_FRACTION of it the one closest to the defaults: fewest techniques (each costs compile time
and, for qwZ, forward precision), then the default bucket cap and prefetch depth. The result is a plain manual Config, which the passes then follow as if the
user had written it: Config(plan="auto") trains exactly as the Config it names in explain().

Every input is the same on every rank (the graph, the agreed cost model, the Config), so every
rank chooses alike; the schedule check compares what they then issue.

Per parameter, shard() asks choose_keep_whole_numel() before any graph exists (the layout must be there
for the optimizer): the small parameters every rank keeps whole, whose gradients are all-reduced.

The step-time model, per rank (bytes are those this rank sends, split by the link they cross;
times are bytes / the link's measured bandwidth plus Config.collective_latency_us per collective):
  comm     = forward gathers + backward gathers + gradient reductions (each collective's time is
             that of its slower link)
  compute  = per node max(FLOPs / compute rate, bytes read and written / memory rate) + kernel_us,
             + QUANTIZE_COPIES copies' time per value quantized or dequantized, and one per value the
             hierarchical reduce packs or sums and the hierarchical gather reorders,
             + on a CPU device, the compute time the bytes sent displace (gloo copies them with the
             cores that compute; CostModel.comm_cpu_s_per_byte)
  step     = compute + comm - overlap * min(compute, comm - first gather bucket - last reduction bucket),
             overlap = prefetch / (prefetch + 1) (0 without prefetch): deeper prefetch hides more of
             the compute-long stretches; the first gather and the last reduction hide behind nothing
An hpZ option over the budget is weighed again with hpZ for the most weights (from the backward's
start) whose secondary shards fit (partial_hpz_estimates; Config.hpz_parameters). Each qwZ option
is weighed again with the forward's tail left out of qwZ (with_tail_variants; Config.qwz_parameters).
Memory: shards + gradient shards (every graph) + hpZ secondary shards (from forward to backward) +
the forward's tail kept gathered (Config.keep_last_weights_gathered, unless qwZ quantizes it; every weight the
backward reads under Config.save_gathered_weights) + (prefetch + 2) buckets as received (in flight,
in use, and a gradient bucket being reduced), one more under the hierarchical gather (its copy
into world order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from .codegen.int4 import chunk_payload_numel
from .codegen.quantize import payload_numel
from .config import DEFAULT_MEMORY_BUDGET_FRACTION, Config
from .cost_model import CostModel, resolve_group
from .layout import ShardedState, ShardingError, ShardSpec
from .passes.buckets import bucket_by_bytes
from .passes.graph_utils import backward_nodes, has_symbolic_shapes
from .passes.recompute import weight_values
from .plan import peak_collective_bytes, weights_gathered_from_inputs
from .topology import Topology

log = logging.getLogger(__name__)

# Options whose estimates are within this fraction of the fastest count as equally fast: the
# plan leaves the defaults (fewest techniques, default buckets and prefetch) only for a clear gain.
# 10%: what the estimate misses on a CPU the ranks share (quantize kernels and gloo's transfers
# compete with the compute for the cores; docs/auto_plan.md).
TIE_FRACTION = 0.10
# Quantizing or dequantizing one value costs this many fp32 copies (docs/qwz_kernels_cpu.md:
# Inductor's quantize takes 3.3 copies' time, its dequantize 8.1); CostModel.elementwise_seconds.
QUANTIZE_COPIES = 6
# Config.plan_trial_steps: at most this many options, each of another set of techniques, are timed.
TRIAL_CANDIDATES = 3
BUCKET_CAPS = (0, 2**20, 4 * 2**20, 25 * 2**20)  # as sent per rank, like Config.gather_bucket_bytes; 0: none
PREFETCH_DEPTHS = (0, 1, 2, 4)
_zpp = torch.ops.zpp


@dataclasses.dataclass(frozen=True)
class Techniques:
    quantize_weights: bool = False
    hpz: bool = False
    hpz_int8: bool = False  # the secondary shard kept as the int8 payloads (needs qwZ)
    quantize_gradients: bool = False
    hierarchical_reduce: bool = False  # lossless; qgZ's reduction is hierarchical already
    hierarchical_gather: bool = False
    # Under qwZ, the forward's tail too (the weights kept gathered into the backward,
    # Config.keep_last_weights_gathered). False: the tail is gathered in its dtype and kept, so the
    # backward gathers it not again; Config.qwz_parameters names the other weights.
    quantize_tail: bool = True

    @property
    def name(self) -> str:
        qwz = "qwZ" if self.quantize_tail else "qwZ except the forward's tail"
        parts = [(qwz, self.quantize_weights), ("hpZ int8" if self.hpz_int8 else "hpZ", self.hpz)]
        parts += [("qgZ", self.quantize_gradients), ("hierarchical reduce", self.hierarchical_reduce)]
        parts.append(("hierarchical gather", self.hierarchical_gather))
        return " + ".join(n for n, on in parts if on) or "ZeRO-3"

    @property
    def count(self) -> int:
        return (
            self.quantize_weights
            + self.hpz
            + self.quantize_gradients
            + self.hierarchical_reduce
            + self.hierarchical_gather
        )


@dataclasses.dataclass(frozen=True)
class Option:
    techniques: Techniques
    bucket_bytes: int
    prefetch: int
    # With hpZ: how many of the weights the backward gathers again take it, those it gathers first
    # (Config.hpz_parameters); None: all. Weighed where the budget cannot hold every secondary shard.
    hpz_weights: Optional[int] = None

    @property
    def name(self) -> str:
        buckets = f"buckets {self.bucket_bytes / 2**20:g} MiB" if self.bucket_bytes else "no buckets"
        partial = "" if self.hpz_weights is None else f" (hpZ for the backward's first {self.hpz_weights} weights)"
        return f"{self.techniques.name}{partial}, {buckets}, prefetch {self.prefetch}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    option: Option
    step_s: float
    compute_s: float
    comm_s: float
    inter_bytes: int
    intra_bytes: int
    memory_bytes: int
    fits: bool


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What a graph's plan depends on: per gathered parameter (shard elements each rank sends,
    bytes per element on the wire, read in backward or not, kept gathered for it or not), per reduced gradient
    (shard elements, bytes per element), each with its block (passes/buckets.py: a bucket never
    spans two blocks of a graph cut by block; None: any), and the graph's own compute (forward,
    and backward when it is a joint graph; 0 under dynamic shapes). Gradients all-reduced (0-d
    parameters, those kept whole) travel alike under every option; they are in for the step's
    time and bytes. Frozen int8 weights are left out."""

    # (shard elements, bytes per element, read in backward, kept gathered for it unless qwZ runs,
    # block), in graph order
    gathers: tuple[tuple[int, int, bool, bool, Optional[str]], ...]
    reductions: tuple[tuple[int, int, Optional[str]], ...]  # (shard elements, bytes per element, block)
    compute_s: float
    training: bool
    all_reduces: tuple[tuple[int, int], ...] = ()  # (elements, bytes per element) of each gradient all-reduced
    saves_gathered_weights: bool = False  # Config.save_gathered_weights: every weight read in backward is kept
    gather_names: tuple[str, ...] = ()  # the parameter of each of `gathers` (what Config.hpz_parameters names)


@dataclasses.dataclass
class AutoPlan:
    """What Config(plan="auto") chose for one graph, and the options it weighed."""

    label: str
    chosen: Estimate
    config: Config
    estimates: list[Estimate]
    budget_bytes: int
    persistent_bytes: int
    links: str
    key: Optional[tuple] = None  # the graph's parameter names and whether it trains (choose_plan)
    # Read off the final graphs once compiled: the most bytes of gathered (and all-to-all) results
    # alive at once per phase (plan.peak_collective_bytes), and hpZ's secondary shards the backward takes.
    peak_collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    secondary_bytes: int = 0
    # Config.plan_trial_steps: the options to time, this plan's first (trial_candidates), and once
    # timed, each one's median step in seconds on the slowest rank (plan_trial.PlanTrial).
    candidates: tuple[Option, ...] = ()
    trial_seconds: dict[Option, float] = dataclasses.field(default_factory=dict)
    kept_by_earlier_trial: bool = False  # a trial of an earlier run on this machine kept this option

    @property
    def awaiting_trial(self) -> bool:
        """Whether the candidates of this plan are still to be timed (Config.plan_trial_steps)."""
        return len(self.candidates) > 1 and not self.trial_seconds

    @property
    def measured_bytes(self) -> int:
        """Persistent state + secondary shards + the larger phase peak of collective results."""
        return self.persistent_bytes + self.secondary_bytes + max(self.peak_collective_bytes.values(), default=0)

    def note_compiled(self, phase: str, gm: fx.GraphModule, hpz_group_name: Optional[str]) -> None:
        # Reduce-scatter and all-reduce results are the gradient shards, counted as persistent.
        self.peak_collective_bytes[phase] = peak_collective_bytes(gm, ops=("all_gather", "all_to_all"))
        if phase == "backward" and self.config.hpz_enabled and hpz_group_name is not None:
            self.secondary_bytes = weights_gathered_from_inputs(gm, hpz_group_name)
        if phase != "forward" and self.measured_bytes > self.budget_bytes:
            log.warning(
                "zpp_compile: %s holds %.1f MB once compiled (shards %.1f, hpZ secondary %.1f, collective results "
                "%.1f), over its %.1f MB budget: the estimate (%s) fell short; lower Config.memory_budget_bytes "
                "to make the plan choose smaller buckets and shallower prefetch",
                self.label,
                self.measured_bytes / 1e6,
                self.persistent_bytes / 1e6,
                self.secondary_bytes / 1e6,
                max(self.peak_collective_bytes.values()) / 1e6,
                self.budget_bytes / 1e6,
                self.chosen.option.name,
            )

    def __str__(self) -> str:
        mb = 1e6
        measured = f"; {self.measured_bytes / mb:.2f} MB once compiled" if self.peak_collective_bytes else ""
        kept = self.config.keep_whole_numel
        whole = f", parameters of up to {kept} elements kept whole" if kept else ""
        lines = [
            f"{self.label}: {self.chosen.option.name}{whole} (estimated {self.chosen.step_s * 1e3:.1f} ms per step and "
            f"{(self.persistent_bytes + self.chosen.memory_bytes) / mb:.2f} MB{measured}, of a "
            f"{self.budget_bytes / mb:.2f} MB budget; {self.links})",
            f"  {'option (chosen *, else the fastest variant)':<52} {'step ms':>9} {'compute':>8} {'comm':>8} "
            f"{'inter MB':>9} {'intra MB':>9} {'added MB':>9}",
        ]
        for e in best_per_techniques(self.estimates, self.chosen):
            mark = "*" if e is self.chosen else ("over budget" if not e.fits else "")
            lines.append(
                f"  {e.option.name:<52} {e.step_s * 1e3:>9.1f} {e.compute_s * 1e3:>8.1f} {e.comm_s * 1e3:>8.1f} "
                f"{e.inter_bytes / mb:>9.2f} {e.intra_bytes / mb:>9.2f} {e.memory_bytes / mb:>9.2f} {mark}"
            )
        if self.trial_seconds:
            lines.append("  timed (median step ms, slowest rank; the fastest kept):")
            lines += [f"    {o.name:<50} {s * 1e3:>9.1f}" for o, s in self.trial_seconds.items()]
        elif self.awaiting_trial:
            lines.append(f"  to be timed: {'; '.join(o.name for o in self.candidates)}")
        elif self.kept_by_earlier_trial:
            lines.append(
                "  kept by the trial of an earlier run on this machine (Config.plan_trial_steps), not timed again"
            )
        return "\n".join(lines)


def best_per_techniques(estimates: list[Estimate], chosen: Estimate) -> list[Estimate]:
    """The chosen estimate, and the fastest of each other set of techniques (within budget where
    one fits), fastest first."""
    best: dict[Techniques, Estimate] = {chosen.option.techniques: chosen}
    for e in estimates:
        if e.option.techniques == chosen.option.techniques:
            continue
        held = best.get(e.option.techniques)
        if held is None or (e.fits, -e.step_s) > (held.fits, -held.step_s):
            best[e.option.techniques] = e
    return sorted(best.values(), key=lambda e: (not e.fits, e.step_s))


def choose_plan(
    gm: fx.GraphModule,
    state: ShardedState,
    label: str,
    *,
    training: bool,
    block: Callable[[fx.Node], Optional[str]] = lambda node: None,
    key: Optional[tuple] = None,
    kept: frozenset[fx.Node] = frozenset(),
    option: Optional[Option] = None,
    name_of: Callable[[fx.Node], Optional[str]] = lambda node: None,
) -> AutoPlan:
    """The plan of one graph (the joint graph when `training`, else the inference graph); `block`
    tells a marker's block as bucketing will (passes.blocks_of). Each graph's plan fits the budget
    on its own: with graph breaks, the hpZ secondary shards of several graphs of one step add up.
    `key` (the graph's parameters and whether it trains): a later graph of the same key -- a
    recompile for other shapes -- takes the first one's plan, so ranks whose shapes part later
    (a last short batch, automatic dynamic shapes) still choose alike. `kept`: the gathers whose
    weights stay gathered into the backward unless qwZ is chosen (passes.kept_for_backward).
    `option`: take this option (a candidate of a trial, Config.plan_trial_steps) instead of choosing.
    `name_of`: the parameter a gather marker reads (what Config.hpz_parameters names).
    Otherwise, with Config.plan_trial_steps on a training graph, the plan lists the candidates to time."""
    earlier = next((p for p in state.auto_plans if p.key == key), None) if key is not None else None
    if earlier is not None and option is None:  # a recompile (other shapes, dynamic): the first graph's choice stands
        return dataclasses.replace(
            earlier, label=label, peak_collective_bytes={}, secondary_bytes=0, candidates=(), trial_seconds={}
        )
    facts = graph_facts(gm, state.cost_model, training, block, state.config.save_gathered_weights, kept, name_of)
    budget = state.memory_budget_bytes
    persistent = persistent_bytes(state)
    estimates = [
        e
        for techniques in with_tail_variants(technique_sets(state.topology, state.config, training), facts)
        for cap in BUCKET_CAPS
        for e in _estimates(
            techniques, cap, PREFETCH_DEPTHS, facts, state.topology, state.cost_model, state.config, budget - persistent
        )  # fmt: skip
    ]
    estimates += partial_hpz_estimates(estimates, facts, state.topology, state.cost_model, state.config,
                                       budget - persistent)  # fmt: skip
    chosen = pick(estimates) if option is None else next(e for e in estimates if e.option == option)
    trial = option is None and training and state.config.plan_trial_steps > 0
    candidates = tuple(e.option for e in trial_candidates(estimates, chosen)) if trial else ()
    kept = state.kept_by_trials.get(trial_key(state.config, key, candidates)) if len(candidates) > 1 else None
    if kept is not None:  # an earlier run's trial of the same candidates: take what it kept
        chosen, candidates = next(e for e in estimates if e.option.name == kept), ()
    plan = AutoPlan(label, chosen, resolved_config(state.config, chosen.option, state.topology,
                                                   keep_whole_numel=state.keep_whole_numel,
                                                   hpz_parameters=hpz_names(chosen.option, facts),
                                                   qwz_parameters=qwz_names(chosen.option, facts)),
                    estimates, budget, persistent, describe_links(state.cost_model), key=key,
                    candidates=candidates, kept_by_earlier_trial=kept is not None)  # fmt: skip
    log.info("zpp_compile: plan of %s", plan)
    return plan


def technique_sets(topology: Topology, config: Config, training: bool) -> list[Techniques]:
    several_nodes = topology.num_nodes > 1 and topology.ranks_per_node > 1
    sets = []
    for qwz in (False, True):
        for hpz in (False, True) if several_nodes and training else (False,):
            for hpz_int8 in (False, True) if hpz and qwz else (False,):
                for qgz in (False, True) if config.allow_lossy and training else (False,):
                    for reduce in (False, True) if several_nodes and training and not qgz else (False,):
                        for gather in (False, True) if several_nodes else (False,):
                            sets.append(Techniques(qwz, hpz, hpz_int8, qgz, reduce, gather))
    return sets


def with_tail_variants(sets: list[Techniques], facts: GraphFacts) -> list[Techniques]:
    """`sets`, and each with qwZ again without the forward's tail, where the graph keeps a tail
    gathered into the backward and every gathered weight has a name for Config.qwz_parameters.
    Under qwZ the tail is gathered again in the backward (its forward copy is rounded); left in
    full precision it is sent once, in its dtype, and never again: fewer bytes without hpZ."""
    if not any(kept for _, _, _, kept, _ in facts.gathers) or not _named(facts):
        return sets
    return sets + [dataclasses.replace(t, quantize_tail=False) for t in sets if t.quantize_weights]


def _named(facts: GraphFacts) -> bool:
    """Whether every gathered weight has a name (what Config.hpz_parameters / qwz_parameters give)."""
    return len(facts.gather_names) == len(facts.gathers) and all(facts.gather_names)


def options(topology: Topology, config: Config, training: bool) -> list[Option]:
    """Every option the plan weighs: techniques x bucket cap x prefetch depth."""
    return [
        Option(t, b, p)
        for t in technique_sets(topology, config, training)
        for b in BUCKET_CAPS
        for p in PREFETCH_DEPTHS
    ]


def pick(estimates: list[Estimate]) -> Estimate:
    fitting = [e for e in estimates if e.fits]
    if not fitting:  # the budget was checked against ZeRO-3 in shard(); a graph can still need more
        smallest = min(estimates, key=lambda e: e.memory_bytes)
        log.warning("zpp_compile: no plan fits the memory budget; taking the smallest (%s)", smallest.option.name)
        return smallest
    fastest = min(e.step_s for e in fitting)
    close = [e for e in fitting if e.step_s <= fastest * (1 + TIE_FRACTION)]
    return min(close, key=_closeness_to_defaults)


def trial_candidates(estimates: list[Estimate], chosen: Estimate) -> list[Estimate]:
    """The options Config.plan_trial_steps times: `chosen`, then, fastest first, the option pick()
    would take within each other family of techniques (`_family`) whose estimate ties with the
    fastest (within TIE_FRACTION), up to TRIAL_CANDIDATES in all. Only `chosen` when nothing ties
    with it."""
    if not chosen.fits:  # nothing fits the budget: pick() took the smallest, nothing to weigh
        return [chosen]
    fastest = min(e.step_s for e in estimates if e.fits)
    tied: dict[Techniques, list[Estimate]] = {}
    for e in (e for e in estimates if e.fits and e.step_s <= fastest * (1 + TIE_FRACTION)):
        tied.setdefault(_family(e), []).append(e)
    tied.pop(_family(chosen), None)
    others = sorted(
        (min(group, key=_closeness_to_defaults) for group in tied.values()),
        key=lambda e: (e.step_s, e.option.techniques.count),
    )
    return [chosen, *others][:TRIAL_CANDIDATES]


def _family(e: Estimate) -> Techniques:
    """An option's techniques, hpZ's secondary int8 or fp32 alike: the two differ by the in-node
    backward gather's bytes, less than a trial of a few steps resolves (run 5 of
    docs/auto_plan.md), so they share one candidate's slot, and its full compile."""
    return dataclasses.replace(e.option.techniques, hpz_int8=False)


def trial_key(config: Config, key: Optional[tuple], candidates: tuple[Option, ...]) -> str:
    """What a trial's result is remembered by (plan_trial.remember_kept): the Config, the graph's
    parameters and whether it trains, and the candidates (which the rates and the graph decide)."""
    text = repr((config, key, [o.name for o in candidates]))
    return hashlib.sha256(text.encode()).hexdigest()


_DEFAULT = Config()


def _closeness_to_defaults(e: Estimate) -> tuple:
    """Fewest techniques first, then the default bucket cap and prefetch depth, then speed."""
    option = e.option
    return (
        option.techniques.count,
        option.bucket_bytes != _DEFAULT.gather_bucket_bytes,
        option.prefetch != _DEFAULT.prefetch_limit,
        e.step_s,
    )


def graph_facts(
    gm: fx.GraphModule,
    cost_model: CostModel,
    training: bool,
    block: Callable[[fx.Node], Optional[str]] = lambda node: None,
    save_gathered_weights: bool = False,
    kept: frozenset[fx.Node] = frozenset(),
    name_of: Callable[[fx.Node], Optional[str]] = lambda node: None,
) -> GraphFacts:
    """Read a graph's gather and reduction markers and add up its compute (with
    Config.save_gathered_weights the backward gathers nothing again: it reads the forward's copies;
    `kept`: gathers the backward does not gather again unless qwZ runs)."""
    read_in_backward = _used_in_backward(gm) if training else set()
    # Under symbolic shapes FLOPs would come from this rank's example sizes, which other ranks may
    # not share: the plan then weighs the communication alone (weights' sizes are static), alike
    # on every rank.
    with_compute = not has_symbolic_shapes(gm)
    gathers, names, reductions, all_reduces, compute_s = [], [], [], [], 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == _zpp.gather_param.default:
            wire = node.kwargs.get("dtype") or node.args[0].meta["val"].dtype
            gathers.append((node.args[3], wire.itemsize, node in read_in_backward, node in kept, block(node)))
            names.append(name_of(node) or "")
        elif node.target == _zpp.reduce_grad.default:
            reductions.append((node.args[2], node.args[0].meta["val"].element_size(), block(node)))
        elif node.target == _zpp.all_reduce_grad.default:
            grad = node.args[0].meta["val"]
            all_reduces.append((grad.numel(), grad.element_size()))
        elif with_compute and node.target not in _MARKERS:
            compute_s += cost_model.node_seconds(node)
    return GraphFacts(
        tuple(gathers), tuple(reductions), compute_s, training, tuple(all_reduces), save_gathered_weights, tuple(names)
    )


def _used_in_backward(joint: fx.GraphModule) -> set[fx.Node]:
    """The gathers of a joint graph whose weight the backward reads (itself, or a view or cast of
    it, as passes/recompute.py sees them): those the backward gathers again, but for the forward's
    tail (kept_for_backward). Backward nodes are those that depend on a tangent."""
    backward = backward_nodes(joint.graph)
    return {
        gather
        for gather in joint.graph.find_nodes(op="call_function", target=_zpp.gather_param.default)
        if any(user in backward for value in weight_values([gather]) for user in value.users)
    }


_MARKERS = {
    _zpp.gather_param.default,
    _zpp.gather_quantized_param.default,
    _zpp.replicated_param.default,
    _zpp.reduce_grad.default,
    _zpp.all_reduce_grad.default,
}


def estimate(
    option: Option, facts: GraphFacts, topology: Topology, cost: CostModel, config: Config, headroom: int
) -> Estimate:
    """The option's step time and memory for this graph (the model in the module docstring)."""
    (single,) = _estimates(
        option.techniques, option.bucket_bytes, (option.prefetch,), facts, topology, cost, config, headroom,
        option.hpz_weights,
    )  # fmt: skip
    return single


def _estimates(
    t: Techniques,
    cap: int,
    prefetch_depths: tuple[int, ...],
    facts: GraphFacts,
    topology: Topology,
    cost: CostModel,
    config: Config,
    headroom: int,
    hpz_weights: Optional[int] = None,
) -> list[Estimate]:
    """estimate() for each prefetch depth of one (techniques, bucket cap[, hpZ's share]): the bytes
    and buckets, hence the communication time, do not depend on the depth, so they are worked out once."""
    links, copies = _links(t, cap, facts, topology, cost, config, hpz_weights)
    comm_s, exposed_s = links.seconds()
    inter, intra = links.bytes("inter"), links.bytes("intra")
    compute_s = facts.compute_s + cost.elementwise_seconds(copies) + cost.comm_cpu_seconds(inter + intra)
    estimates = []
    for prefetch in prefetch_depths:
        option = Option(t, cap, prefetch, hpz_weights)
        overlap = prefetch / (prefetch + 1)
        step_s = compute_s + comm_s - overlap * min(compute_s, comm_s - exposed_s)
        memory = _plan_memory(option, facts, topology, config)
        estimates.append(Estimate(option, step_s, compute_s, comm_s, inter, intra, memory, memory <= headroom))
    return estimates


def _links(
    t: Techniques,
    cap: int,
    facts: GraphFacts,
    topology: Topology,
    cost: CostModel,
    config: Config,
    hpz_weights: Optional[int] = None,
) -> tuple[_Links, int]:
    """What the techniques send per phase and link, bucketed under `cap`, and how many element
    copies' time they add per step (QUANTIZE_COPIES per value quantized or dequantized)."""
    world, local, nodes = topology.world_size, topology.ranks_per_node, topology.num_nodes
    links = _Links(cost, world, local, cap, hierarchical_gather=t.hierarchical_gather)
    block, gradient_block = config.weight_block_size, config.gradient_block_size
    quantized = copied = 0
    int8 = int8_gathers(t, facts)
    covered = hpz_covered(t, facts, hpz_weights, int8)
    for i, (shard_numel, wire_size, read_in_backward, kept, block_name) in enumerate(facts.gathers):
        full = shard_numel * world
        wire = payload_numel(shard_numel, block) if int8[i] else shard_numel * wire_size
        copied += links.all_gather("forward", wire, world, block_name)
        quantized += (shard_numel + full) if int8[i] else 0
        if not _regathered(read_in_backward, kept, int8[i], facts):
            continue
        if i in covered:  # each rank keeps 1/local of the gathered payloads (int8) or of the full weight
            int8_secondary = t.hpz_int8 and int8[i]
            part = world // local * payload_numel(shard_numel, block) if int8_secondary else full // local * wire_size
            links.all_gather("backward", part, local, block_name)
            quantized += full if int8_secondary else 0
        else:
            copied += links.all_gather("backward", shard_numel * wire_size, world, block_name)
    for shard_numel, reduce_size, block_name in facts.reductions:
        full = shard_numel * world
        if t.hierarchical_reduce:  # all-to-all in the node, then of the node sums across nodes
            size = full * reduce_size
            links.send("reduce", size, size * (local - 1) // local, size // local * (nodes - 1) // nodes, block_name)
            copied += full + full // local  # packed by destination, then the node sums (the rest fuses)
        elif t.quantize_gradients:  # int4 all-to-all in the node, then of the partial sums across nodes
            int4, partial = (
                chunk_payload_numel(full, gradient_block),
                chunk_payload_numel(full // local, gradient_block),
            )
            links.send(
                "reduce", full * reduce_size, int4 * (local - 1) // local, partial * (nodes - 1) // nodes, block_name
            )
            quantized += 2 * full + 2 * full // local
        else:  # a reduce-scatter sends what an all-gather does; its bucket cap counts the full gradient
            intra, inter = _peer_split(shard_numel * reduce_size, world, local)
            links.send("reduce", full * reduce_size, intra, inter, block_name)
    # Bucketed as bucket_collectives does (across blocks), each bucket sent as one collective: the
    # counter rounds 2 x bytes / world per collective.
    for bucket in bucket_by_bytes(list(facts.all_reduces), lambda item: item[0] * item[1], cap, lambda item: None):
        nbytes = sum(numel * size for numel, size in bucket)
        links.send("all_reduce", nbytes, *_peer_split(2 * nbytes // world, world, local), None)
    return links, QUANTIZE_COPIES * quantized + copied


class _Links:
    """Bytes this rank sends per phase and link, and the buckets (under one cap) they travel in."""

    def __init__(self, cost: CostModel, world: int, local: int, cap: int, hierarchical_gather: bool = False) -> None:
        self.cost, self.world, self.local, self.cap = cost, world, local, cap
        self.hierarchical_gather = hierarchical_gather
        # phase -> one (bytes as the bucket cap counts them, intra bytes, inter bytes, block) per
        # parameter, in graph order
        self.phases: dict[str, list[tuple[int, int, int, Optional[str]]]] = {}

    def all_gather(self, phase: str, part: int, group: int, block: Optional[str]) -> int:
        """An all-gather of a `part` of bytes from each of `group` ranks (a node's ranks first);
        returns what the hierarchical gather copies into world order, in fp32 values (0 if not one)."""
        if self.hierarchical_gather and group == self.world and 1 < self.local < self.world:
            nodes = self.world // self.local  # the part to each other node's counterpart, then N parts in the node
            self.send(phase, part, part * nodes * (self.local - 1), part * (nodes - 1), block)
            return part * self.world // 4
        self.send(phase, part, *_peer_split(part, group, self.local), block)
        return 0

    def send(self, phase: str, counted: int, intra: int, inter: int, block: Optional[str]) -> None:
        self.phases.setdefault(phase, []).append((counted, intra, inter, block))

    def bytes(self, link: str) -> int:
        """Bytes sent over the "intra" or "inter" node link, every phase."""
        column = 1 if link == "intra" else 2
        return sum(item[column] for items in self.phases.values() for item in items)

    def seconds(self) -> tuple[float, float]:
        """(every bucket's time, what prefetch cannot hide: the first forward bucket and the last
        gradient buckets -- the all-reduces of the parameters kept whole wait for the end of backward)."""
        times = {
            phase: [self._seconds(bucket) for bucket in bucket_by_bytes(items, _counted, self.cap, _block)]
            for phase, items in self.phases.items()
        }
        ends = [("forward", 0), ("reduce", -1), ("all_reduce", -1)]
        exposed = sum(times[phase][i] for phase, i in ends if phase in times)
        return sum(t for phase_times in times.values() for t in phase_times), exposed

    def _seconds(self, bucket: list[tuple]) -> float:
        intra, inter = sum(item[1] for item in bucket), sum(item[2] for item in bucket)
        return max(self.cost.collective_seconds(intra, False), self.cost.collective_seconds(inter, True))


def hpz_covered(
    t: Techniques, facts: GraphFacts, hpz_weights: Optional[int], int8: Optional[list[bool]] = None
) -> set[int]:
    """The gathers (indices into facts.gathers) whose weights the backward gathers again from hpZ's
    secondary shards: every one gathered again, or the last `hpz_weights` of them in graph order,
    the first the backward gathers. `int8`: int8_gathers(t, facts), where the caller has it."""
    if not t.hpz:
        return set()
    int8 = int8_gathers(t, facts) if int8 is None else int8
    again = [i for i, (_, _, read, kept, _) in enumerate(facts.gathers) if _regathered(read, kept, int8[i], facts)]
    return set(again if hpz_weights is None else again[len(again) - hpz_weights :])


def hpz_names(option: Option, facts: GraphFacts) -> Optional[tuple[str, ...]]:
    """Config.hpz_parameters for `option`: None unless it gives hpZ to some weights only."""
    if option.hpz_weights is None:
        return None
    covered = hpz_covered(option.techniques, facts, option.hpz_weights)
    return tuple(sorted({facts.gather_names[i] for i in covered}))


def partial_hpz_estimates(
    estimates: list[Estimate],
    facts: GraphFacts,
    topology: Topology,
    cost: CostModel,
    config: Config,
    headroom: int,
) -> list[Estimate]:
    """For each hpZ option over the budget: the same option with hpZ for as many of the weights the
    backward gathers first as the budget holds the secondary shards of (none where not even one
    fits). A secondary shard costs memory in proportion to what it saves on the link between
    nodes, so which weights take it matters less than how many bytes of them the budget holds.
    None where a gathered weight has no name for Config.hpz_parameters to give."""
    if not _named(facts):
        return []
    partial = []
    for e in estimates:
        if not e.option.techniques.hpz or e.fits or e.option.hpz_weights is not None:
            continue
        weights = _most_hpz_weights(e.option, facts, topology, config, headroom)
        if weights:
            option = dataclasses.replace(e.option, hpz_weights=weights)
            partial.append(estimate(option, facts, topology, cost, config, headroom))
    return partial


def _most_hpz_weights(option: Option, facts: GraphFacts, topology: Topology, config: Config, headroom: int) -> int:
    """The most weights (from the backward's start) `option` can give hpZ within `headroom` (memory
    grows with their number: a binary search)."""
    low, high = 0, len(hpz_covered(option.techniques, facts, None))
    while low < high:
        middle = (low + high + 1) // 2
        memory = _plan_memory(dataclasses.replace(option, hpz_weights=middle), facts, topology, config)
        low, high = (middle, high) if memory <= headroom else (low, middle - 1)
    return low


def int8_gathers(t: Techniques, facts: GraphFacts) -> list[bool]:
    """Per gather of `facts`, whether qwZ sends it int8: all under qwZ, but for the tail's weights
    (every gather of a parameter the tail reads) where the techniques leave the tail out."""
    if t.quantize_tail or not t.quantize_weights:
        return [t.quantize_weights] * len(facts.gathers)
    tail = {name for name, (_, _, _, kept, _) in zip(facts.gather_names, facts.gathers) if kept}
    return [name not in tail for name in facts.gather_names]


def qwz_names(option: Option, facts: GraphFacts) -> Optional[tuple[str, ...]]:
    """Config.qwz_parameters for `option`: None unless it leaves the forward's tail out of qwZ."""
    if option.techniques.quantize_tail or not option.techniques.quantize_weights:
        return None
    int8 = int8_gathers(option.techniques, facts)
    return tuple(sorted({name for name, quantized in zip(facts.gather_names, int8) if quantized}))


def _regathered(used_in_backward: bool, kept: bool, int8: bool, facts: GraphFacts) -> bool:
    """Whether the backward gathers a weight again: kept weights only when qwZ sent them int8; none
    where the forward's gathered weights are all saved (they are then held, qwZ's as dequantized)."""
    return used_in_backward and not facts.saves_gathered_weights and (int8 or not kept)


def _counted(item: tuple) -> int:  # what the bucket cap counts of a _Links entry
    return item[0]


def _block(item: tuple) -> Optional[str]:
    return item[3]


def _peer_split(part: int, group: int, local: int) -> tuple[int, int]:
    """(intra, inter) bytes of sending `part` to every other rank of a group of `group` ranks
    that starts at a node's first rank."""
    intra_peers = min(group, local) - 1
    return part * intra_peers, part * (group - 1 - intra_peers)


def _plan_memory(option: Option, facts: GraphFacts, topology: Topology, config: Config) -> int:
    """Bytes the option adds over the persistent shards: hpZ's secondary shards, the forward's tail
    held gathered into the backward, and collective results -- buckets of gathered weights as
    received (int8 under qwZ) -- in flight and in use."""
    world, local, block, t = topology.world_size, topology.ranks_per_node, config.weight_block_size, option.techniques
    forward, backward, secondary, held = [], [], 0, 0
    quantized = int8_gathers(t, facts)
    covered = hpz_covered(t, facts, option.hpz_weights, quantized)
    for i, (shard_numel, wire_size, read_in_backward, kept, _) in enumerate(facts.gathers):
        int8 = world * payload_numel(shard_numel, block)
        full = shard_numel * world * wire_size
        forward.append(int8 if quantized[i] else full)
        if not read_in_backward:  # (only a joint graph's gathers are)
            continue
        if not _regathered(read_in_backward, kept, quantized[i], facts):
            held += full  # alive from its gather in the forward until the backward has read it
            continue
        int8_secondary = t.hpz_int8 and quantized[i] and i in covered  # others move the weight's dtype
        backward.append(int8 if int8_secondary else full)
        secondary += (int8 if int8_secondary else full) // local if i in covered else 0
    bucket = max(
        _bucket_received(forward, option.bucket_bytes, world), _bucket_received(backward, option.bucket_bytes, world)
    )
    if t.quantize_gradients and config.qgz_error_feedback:  # bf16, about one unsharded gradient
        secondary += sum(2 * shard_numel * world for shard_numel, _, _ in facts.reductions)
    # + the hierarchical gather's copy into world order of the bucket in use
    return secondary + held + (option.prefetch + 2 + t.hierarchical_gather) * bucket


def _bucket_received(received: list[int], cap: int, world: int) -> int:
    """The largest bucket of a phase's gathers as received: parameters merge up to `cap` bytes as
    sent (world x cap received); none is split; cap 0: one collective per parameter."""
    if not received:
        return 0
    return max(max(received), min(cap * world, sum(received)))


def persistent_bytes(state: ShardedState) -> int:
    """Shards and gradient shards of every parameter of the model, on this rank."""
    total = 0
    for spec in state.specs.values():
        if spec.quantized_block is not None:  # a frozen weight stored as its int8 payload
            total += payload_numel(spec.shard_numel, spec.quantized_block)
            continue
        shard = spec.shard_numel * spec.dtype.itemsize
        total += shard * (2 if spec.requires_grad else 1)  # a frozen parameter has no gradient shard
    return total


def zero3_floor_bytes(state: ShardedState) -> int:
    """The least ZeRO-3 needs: persistent state, one gathered parameter and its full gradient."""
    largest = max((s.padded_numel * (s.compute_dtype or s.dtype).itemsize for s in state.specs.values()), default=0)
    return persistent_bytes(state) + 2 * largest


def choose_keep_whole_numel(state: ShardedState) -> int:
    """shard(): the Config.keep_whole_numel the plan chooses: parameters of at most this many
    elements are kept whole on every rank (DTensor Replicate) rather than sharded.

    A parameter is small when its gradient's all-reduce sends no more bytes over the slowest link
    the world spans than that link carries in the fixed cost of one collective (the cost model's
    latency; the gradient travels in its reduce dtype): its traffic is lost in the collectives'
    fixed costs either way. Sharded, it would
    still take a slot in a gather, a regather and a reduction every step (copies into and out of
    each bucket; under qwZ its shard padded to a whole quantization block); kept whole, its
    gradient is all-reduced, in one bucket with the others (bucket_collectives). The threshold
    grows from the smallest parameter up while every parameter below it is small and what they
    add on this rank (the rest of each parameter, and of its gradient) stays within half of what
    the budget leaves above ZeRO-3's floor: the other half is the graphs' plans'. (Like the budget,
    this leaves the optimizer out: AdamW's two states of a kept-whole parameter are whole too.)
    """
    cost, topology = state.cost_model, state.topology
    world = topology.world_size
    if cost is None or world == 1:
        return 0
    rate = cost.inter_node_bytes_per_s if topology.num_nodes > 1 else cost.intra_node_bytes_per_s
    headroom = (state.memory_budget_bytes - zero3_floor_bytes(state)) // 2
    threshold = 0
    for numel, specs in itertools.groupby(_whole_candidates(state.specs.values()), key=lambda s: s.numel):
        specs = list(specs)
        size = max((s.reduce_dtype or s.compute_dtype or s.dtype).itemsize for s in specs)
        added = sum((s.numel - s.shard_numel) * s.dtype.itemsize * (2 if s.requires_grad else 1) for s in specs)
        if 2 * numel * size * (world - 1) / world / rate > cost.latency_s or added > headroom:
            break
        headroom -= added
        threshold = numel
    return threshold


def _whole_candidates(specs: Iterable[ShardSpec]) -> list[ShardSpec]:
    """Parameters Config.keep_whole_numel may keep whole, smallest first: not 0-d (always whole),
    not empty, not frozen weights stored int8 (their payload is sharded)."""
    return sorted((s for s in specs if s.numel and s.shape and s.quantized_block is None), key=lambda s: s.numel)


def kept_whole_names(specs: Iterable[ShardSpec], threshold: int) -> set[str]:
    """The parameters Config.keep_whole_numel=threshold keeps whole."""
    return {s.fqn for s in _whole_candidates(specs) if s.numel <= threshold}


def default_budget(device: torch.device, ranks_per_node: int) -> int:
    """DEFAULT_MEMORY_BUDGET_FRACTION of the device's memory (CPU: the machine's, per rank of the node)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_MEMORY_BUDGET_FRACTION)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(machine / ranks_per_node * DEFAULT_MEMORY_BUDGET_FRACTION)


def settle_budget(state: ShardedState, device: torch.device) -> None:
    """shard(): the budget every rank plans with (the Config's, else the smallest rank's default:
    one all-reduce, so ranks on different hardware still choose alike), kept on the state; a
    budget below what ZeRO-3 itself needs is refused with the figures."""
    budget = state.config.memory_budget_bytes
    if budget is None:
        smallest = torch.tensor([default_budget(device, state.topology.ranks_per_node)], device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=resolve_group(state.topology.world_group_name))
        budget = int(smallest.item())
    state.memory_budget_bytes = budget
    floor = zero3_floor_bytes(state)
    if budget >= floor:
        return
    mb = 1e6
    raise ShardingError(
        f"Config(plan='auto', memory_budget_bytes={budget}) cannot hold even ZeRO-3 on this rank: shards and "
        f"gradient shards take {persistent_bytes(state) / mb:.1f} MB and the largest parameter gathered with "
        f"its gradient {(floor - persistent_bytes(state)) / mb:.1f} MB, {floor / mb:.1f} MB in all. Raise "
        f"memory_budget_bytes to at least {floor}, or shard over more ranks."
    )


def resolved_config(
    config: Config,
    option: Option,
    topology: Topology,
    *,
    keep_whole_numel: int,
    hpz_parameters: Optional[tuple[str, ...]] = None,
    qwz_parameters: Optional[tuple[str, ...]] = None,
) -> Config:
    """The manual Config the option stands for (with the threshold shard() chose, and the names of
    the weights hpZ covers, or qwZ quantizes, where the option gives it to some only): what the
    passes read."""
    t = option.techniques
    feedback = config.qgz_error_feedback and t.quantize_gradients
    return dataclasses.replace(
        config,
        plan="manual",
        memory_budget_bytes=None,
        allow_lossy=False,
        plan_trial_steps=0,
        quantize_weights=t.quantize_weights,
        qwz_parameters=qwz_parameters if t.quantize_weights else None,
        hpz_size=topology.ranks_per_node if t.hpz else None,
        # Without qwZ only frozen int8 weights can keep an int8 secondary: leave them that default.
        hpz_quantized_secondary=t.hpz_int8 or not (t.hpz and t.quantize_weights),
        hpz_parameters=hpz_parameters if t.hpz else None,
        quantize_gradients=t.quantize_gradients,
        hierarchical_reduce=t.hierarchical_reduce,
        hierarchical_gather=t.hierarchical_gather,
        qgz_error_feedback=feedback,
        qgz_error_beta=config.qgz_error_beta if feedback else 0.0,
        gather_bucket_bytes=option.bucket_bytes,
        reduce_bucket_bytes=option.bucket_bytes,
        prefetch_limit=option.prefetch,
        keep_whole_numel=keep_whole_numel,
    )


def topology_for(plan_config: Config, topology: Topology) -> Topology:
    """The topology the passes see: without the hpZ group when the plan does not use hpZ."""
    if plan_config.hpz_enabled:
        return topology
    return dataclasses.replace(topology, hpz_size=1, hpz_group_name=None)


def describe_links(cost: CostModel) -> str:
    cpu = f"; {cost.comm_cpu_s_per_byte * 1e9:.3g} ns of compute per byte sent" if cost.comm_cpu_s_per_byte else ""
    return (
        f"links {cost.intra_node_bytes_per_s * 8 / 1e9:.3g} Gbit/s in a node, "
        f"{cost.inter_node_bytes_per_s * 8 / 1e9:.3g} between nodes; compute {cost.flops_per_s / 1e12:.3g} TFLOP/s"
        f"{cpu}"
    )
