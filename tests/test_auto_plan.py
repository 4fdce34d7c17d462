"""Config(plan="auto"): each graph's communication plan, chosen by the cost model within a budget."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zpp_compile
from zpp_compile.auto_plan import (
    TRIAL_CANDIDATES,
    Estimate,
    GraphFacts,
    Option,
    Techniques,
    estimate,
    hpz_names,
    options,
    partial_hpz_estimates,
    pick,
    qwz_names,
    resolved_config,
    technique_sets,
    trial_candidates,
    with_tail_variants,
)
from zpp_compile.backend import compiled_graphs
from zpp_compile.codegen.quantize import payload_numel
from zpp_compile.cost_model import CostModel
from zpp_compile.topology import Topology

from .models import batch, build, loss_of
from .workers import reset_process_state

TWO_NODES = Topology(world_size=4, rank=0, ranks_per_node=2, world_group_name="world")
ONE_NODE = Topology(world_size=4, rank=0, ranks_per_node=4, world_group_name="world")
# A GPT-like graph: 24 gathered weights of 64K elements per rank (4 bytes each, all re-gathered in
# backward, all reduced) and 0.1 s of compute.
FACTS = GraphFacts(
    gathers=((65536, 4, True, False, None),) * 24, reductions=((65536, 4, None),) * 24, compute_s=0.1, training=True
)
SLOW_LINKS = dict(inter_node_gbps=0.1, intra_node_gbps=10.0)


def _cost(inter_gbps: float, intra_gbps: float, tflops: float = 1.0) -> CostModel:
    return CostModel(intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8, tflops * 1e12)


def _chosen(
    topology: Topology, cost: CostModel, headroom: int = 2**40, facts: GraphFacts = FACTS, **config
) -> Estimate:
    config = zpp_compile.Config(plan="auto", **config)
    estimates = [estimate(o, facts, topology, cost, config, headroom) for o in options(topology, config, True)]
    return pick(estimates)


def test_a_slow_link_between_nodes_gets_qwz_hpz_with_int8_secondary_shards_and_hierarchical_collectives():
    chosen = _chosen(TWO_NODES, _cost(0.1, 10.0))
    assert chosen.option.techniques == Techniques(
        quantize_weights=True, hpz=True, hpz_int8=True, hierarchical_reduce=True, hierarchical_gather=True
    )


def test_the_hierarchical_reduce_sends_half_the_gradient_bytes_between_nodes_of_two_ranks():
    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 10.0)
    flat, hierarchical = (
        estimate(Option(Techniques(hierarchical_reduce=h), 0, 2), FACTS, TWO_NODES, cost, config, 2**40)
        for h in (False, True)
    )
    gradients = sum(4 * n * b for n, b, _ in FACTS.reductions)  # each rank's whole gradient bytes
    # flat: a rank sends its two peers on the other node their quarter; hierarchical: its node sum
    # of the two chunks of its local index, half of it to the other node.
    assert flat.inter_bytes - hierarchical.inter_bytes == gradients // 2 - gradients // 4
    # In the node: flat sends its peer a quarter, hierarchical half of the whole gradient.
    assert hierarchical.intra_bytes - flat.intra_bytes == gradients // 2 - gradients // 4


def test_the_hierarchical_gather_sends_each_part_once_to_the_other_node():
    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 10.0)
    flat, hierarchical = (
        estimate(Option(Techniques(hierarchical_gather=h), 0, 2), FACTS, TWO_NODES, cost, config, 2**40)
        for h in (False, True)
    )
    parts = 2 * sum(n * b for n, b, _, _, _ in FACTS.gathers)  # forward and backward, this rank's part each
    # flat: its part to both ranks of the other node and to its node peer; hierarchical: to its
    # counterpart on the other node, then the two parts it holds to its node peer.
    assert flat.inter_bytes - hierarchical.inter_bytes == parts
    assert hierarchical.intra_bytes - flat.intra_bytes == parts
    assert hierarchical.compute_s > flat.compute_s  # the copy into world order


def test_gradients_are_quantized_only_when_lossy_plans_are_allowed():
    assert not _chosen(TWO_NODES, _cost(0.1, 10.0)).option.techniques.quantize_gradients
    lossy = _chosen(TWO_NODES, _cost(0.1, 10.0), allow_lossy=True).option.techniques
    assert lossy == Techniques(
        quantize_weights=True, hpz=True, hpz_int8=True, quantize_gradients=True, hierarchical_gather=True
    )


def test_when_compute_hides_the_links_the_plan_with_fewest_techniques_wins():
    # 400 Gbit/s links and 10 s of compute: every option's step is the compute's.
    facts = dataclasses.replace(FACTS, compute_s=10.0)
    config = zpp_compile.Config(plan="auto")
    estimates = [
        estimate(o, facts, TWO_NODES, _cost(400, 400), config, 2**40) for o in options(TWO_NODES, config, True)
    ]
    assert pick(estimates).option.techniques == Techniques()


def test_on_a_cpu_bytes_sent_cost_compute_even_where_the_links_are_fast():
    # The same fast links, but every byte gloo sends takes 5 ns from this rank's compute (CPUs
    # the ranks share): the plan then sends fewer bytes, which compute cannot hide.
    facts = dataclasses.replace(FACTS, compute_s=0.05)
    config = zpp_compile.Config(plan="auto")
    fast = _cost(400, 400)
    on_cpu = dataclasses.replace(fast, comm_cpu_s_per_byte=5e-9)
    zero3 = Option(Techniques(), 25 * 2**20, 2)
    free, charged = (estimate(zero3, facts, TWO_NODES, c, config, 2**40) for c in (fast, on_cpu))
    sent = charged.inter_bytes + charged.intra_bytes
    assert charged.compute_s - free.compute_s == pytest.approx(5e-9 * sent)
    assert _chosen(TWO_NODES, fast, facts=facts).option.techniques == Techniques()
    chosen = _chosen(TWO_NODES, on_cpu, facts=facts)
    assert chosen.option.techniques.quantize_weights, chosen.option.name
    assert chosen.inter_bytes + chosen.intra_bytes < sent / 2


def test_one_node_never_weighs_hpz():
    config = zpp_compile.Config(plan="auto", allow_lossy=True)
    assert not any(o.techniques.hpz for o in options(ONE_NODE, config, True))
    assert not any(o.techniques.hpz or o.techniques.quantize_gradients for o in options(TWO_NODES, config, False))
    assert not any(o.techniques.hierarchical_reduce for o in options(ONE_NODE, config, True))
    # qgZ's reduction is hierarchical already: the two are never weighed together.
    assert not any(
        o.techniques.hierarchical_reduce and o.techniques.quantize_gradients for o in options(TWO_NODES, config, True)
    )


def test_a_tight_budget_rules_out_the_options_that_do_not_fit():
    free = _chosen(TWO_NODES, _cost(0.1, 10.0))
    tight = _chosen(TWO_NODES, _cost(0.1, 10.0), headroom=free.memory_bytes - 1)
    assert tight.fits and tight.memory_bytes < free.memory_bytes


def test_the_tail_kept_gathered_counts_in_memory_until_qwz_gathers_it_again():
    # One more weight of 64K elements per rank, the forward's last, kept gathered for the backward.
    def with_last(read_in_backward: bool, kept: bool) -> GraphFacts:
        return dataclasses.replace(FACTS, gathers=FACTS.gathers + ((65536, 4, read_in_backward, kept, None),))

    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 10.0)
    for o in options(TWO_NODES, config, True):
        kept, gathered_again, gone = (
            estimate(o, with_last(*flags), TWO_NODES, cost, config, 2**40).memory_bytes
            for flags in ((True, True), (True, False), (False, False))
        )
        if o.techniques.quantize_weights:  # qwZ gathers it again whatever the flag says
            assert kept == gathered_again, o
        else:  # held whole, as gathered: nothing of it past the forward when the backward never reads it
            assert kept == gone + 4 * 65536 * 4, o


def test_saved_gathered_weights_are_held_in_memory_and_never_gathered_again():
    saved = dataclasses.replace(FACTS, saves_gathered_weights=True)
    not_read = dataclasses.replace(FACTS, gathers=tuple((n, b, False, False, blk) for n, b, _, _, blk in FACTS.gathers))
    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 10.0)
    every_weight = sum(4 * n * b for n, b, _, _, _ in FACTS.gathers)
    for o in options(TWO_NODES, config, True):
        held, none_read = (estimate(o, f, TWO_NODES, cost, config, 2**40) for f in (saved, not_read))
        # Every weight the backward reads stays whole (qwZ's dequantized); no backward gather, as
        # when the backward reads none.
        assert held.memory_bytes == none_read.memory_bytes + every_weight, o
        assert (held.inter_bytes, held.intra_bytes) == (none_read.inter_bytes, none_read.intra_bytes), o


# Ten times FACTS' weights: hpZ's secondary shards then outweigh the buckets, as in a large model.
MANY_WEIGHTS = dataclasses.replace(
    FACTS, gathers=FACTS.gathers * 10, reductions=FACTS.reductions * 10, compute_s=1.0,
    gather_names=tuple(f"w{i:03d}" for i in range(240)),
)  # fmt: skip


def test_a_budget_short_of_every_secondary_shard_gives_hpz_to_the_weights_the_backward_gathers_first():
    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 10.0)

    def weighed(headroom: int) -> list[Estimate]:
        estimates = [
            estimate(o, MANY_WEIGHTS, TWO_NODES, cost, config, headroom) for o in options(TWO_NODES, config, True)
        ]
        return estimates + partial_hpz_estimates(estimates, MANY_WEIGHTS, TWO_NODES, cost, config, headroom)

    unbounded = weighed(2**40)
    free = pick(unbounded)
    assert free.option.techniques.hpz and free.option.hpz_weights is None
    # Two thirds of what the leanest option with hpZ for every weight needs.
    headroom = min(e.memory_bytes for e in unbounded if e.option.techniques.hpz) * 2 // 3
    estimates = weighed(headroom)
    tight = pick(estimates)
    weights = tight.option.hpz_weights
    assert tight.option.techniques.hpz and 0 < weights < 240 and tight.memory_bytes <= headroom
    # As many weights as the budget holds: one more would not fit.
    one_more = dataclasses.replace(tight.option, hpz_weights=weights + 1)
    assert not estimate(one_more, MANY_WEIGHTS, TWO_NODES, cost, config, headroom).fits
    # Faster than every plan without hpZ that fits, slower than hpZ for every weight.
    assert free.step_s < tight.step_s < min(e.step_s for e in estimates if e.fits and not e.option.techniques.hpz)
    assert f"(hpZ for the backward's first {weights} weights)" in tight.option.name
    # The weights the backward gathers first are the forward's last; the Config names them.
    names = hpz_names(tight.option, MANY_WEIGHTS)
    assert names == tuple(f"w{i:03d}" for i in range(240 - weights, 240))
    resolved = resolved_config(config, tight.option, TWO_NODES, keep_whole_numel=0, hpz_parameters=names)
    assert resolved.hpz_size == 2 and resolved.hpz_parameters == names


# FACTS and, last in the forward, a named weight of 64K elements per rank kept gathered into the
# backward (a tied output head).
WITH_TAIL = dataclasses.replace(
    FACTS, gathers=FACTS.gathers + ((65536, 4, True, True, None),),
    gather_names=tuple(f"w{i:02d}" for i in range(24)) + ("head",),
)  # fmt: skip


def _weighed(topology: Topology, facts: GraphFacts) -> list[Estimate]:
    config, cost = zpp_compile.Config(plan="auto"), _cost(0.1, 0.1)
    sets = with_tail_variants(technique_sets(topology, config, True), facts)
    return [estimate(Option(t, 25 * 2**20, 2), facts, topology, cost, config, 2**40) for t in sets]


def test_qwz_leaves_the_tail_out_where_that_sends_fewer_bytes():
    estimates = _weighed(ONE_NODE, WITH_TAIL)
    every = next(e for e in estimates if e.option.techniques == Techniques(quantize_weights=True))
    but_tail = next(e for e in estimates if e.option.techniques == Techniques(True, quantize_tail=False))
    # The head is sent once, in fp32, instead of int8 in the forward and in fp32 again in the
    # backward: the int8 payload fewer to each of the 3 peers.
    assert every.intra_bytes - but_tail.intra_bytes == 3 * payload_numel(65536, 256) > 0
    assert pick(estimates) is but_tail and "qwZ except the forward's tail" in but_tail.option.name
    assert qwz_names(but_tail.option, WITH_TAIL) == WITH_TAIL.gather_names[:-1]
    resolved = resolved_config(
        zpp_compile.Config(plan="auto"), but_tail.option, ONE_NODE, keep_whole_numel=0,
        qwz_parameters=qwz_names(but_tail.option, WITH_TAIL),
    )  # fmt: skip
    assert resolved.quantize_weights and resolved.qwz_parameters == WITH_TAIL.gather_names[:-1]
    # Under hpZ the head's backward gather stays in the node: int8 in the forward crosses less.
    with_hpz = pick(_weighed(TWO_NODES, WITH_TAIL)).option.techniques
    assert with_hpz.hpz and with_hpz.quantize_weights and with_hpz.quantize_tail, with_hpz
    # No variant where no weight is kept, or where a weight has no name to leave out by.
    for facts in (FACTS, dataclasses.replace(WITH_TAIL, gather_names=())):
        assert all(e.option.techniques.quantize_tail for e in _weighed(ONE_NODE, facts))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(plan="auto", quantize_weights=True), "chooses quantize_weights itself"),
        (dict(plan="auto", hpz_size=2, prefetch_limit=1), "chooses hpz_size, prefetch_limit itself"),
        (dict(plan="auto", hpz_parameters=("fc.weight",)), "chooses hpz_parameters itself"),
        (dict(plan="auto", qwz_parameters=("fc.weight",)), "chooses qwz_parameters itself"),
        (dict(memory_budget_bytes=2**30), "read by the automatic plan only; add plan='auto'"),
        (dict(allow_lossy=True), "read by the automatic plan only"),
        (dict(plan="fast"), "not a plan mode"),
        (dict(plan="auto", memory_budget_bytes=0), "memory_budget_bytes=0 is out of range"),
        (dict(plan_trial_steps=3), "plan_trial_steps is read by the automatic plan only"),
        (dict(plan="auto", plan_trial_steps=-1), "plan_trial_steps=-1 is out of range"),
    ],
)
def test_config_refuses_settings_the_plan_would_override(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zpp_compile.Config(**kwargs)


def _train(name: str, config: zpp_compile.Config, steps: int = 2) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="zeropp")
    counter = zpp_compile.comm_counter()
    grads = []
    for step in range(steps):
        counter.reset()
        x, y = batch(name, 2 * world, step)
        loss_of(name, compiled, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    auto = config.plan == "auto"
    plans = zpp_compile.explain(model).auto_plans if auto else []
    result = {
        "grads": grads,
        "inter": counter.bytes(locality="inter"),
        "intra": counter.bytes(locality="intra"),
        "plans": [(p.chosen.option.name, p.chosen.inter_bytes, p.chosen.intra_bytes) for p in plans],
        "configs": [p.config for p in plans],
        "measured_bytes": [p.measured_bytes for p in plans],
        "budget": [p.budget_bytes for p in plans],
        "text": str(zpp_compile.explain(model)) if auto else "",
        "trial_seconds": [{o.name: s for o, s in p.trial_seconds.items()} for p in plans],
        "compiled_plans": [r.auto_plan.chosen.option.name for r in compiled_graphs() if r.auto_plan is not None],
        "persistent_bytes": [p.persistent_bytes for p in plans],
        # Per plan, the least the options without hpZ and those giving every weight hpZ add to
        # what persists.
        "least_added_bytes": [
            (
                min(e.memory_bytes for e in p.estimates if not e.option.techniques.hpz),
                min(
                    (e.memory_bytes for e in p.estimates if e.option.techniques.hpz and e.option.hpz_weights is None),
                    default=None,  # one node: no hpZ
                ),
            )
            for p in plans
        ],  # fmt: skip
    }
    reset_process_state()
    return result


def auto_and_the_config_it_chose(name: str, config: dict) -> dict:
    auto = _train(name, zpp_compile.Config(ranks_per_node=2, plan="auto", lowering="aot_eager", **config))
    manual = _train(name, auto["configs"][0])
    return {"auto": auto, "manual": manual}


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_auto_trains_exactly_as_the_manual_config_it_names_and_its_bytes_are_the_estimate(pools, name):
    results = pools(4).run(auto_and_the_config_it_chose, name, {**SLOW_LINKS, "compute_tflops": 1.0})
    plans = {tuple(r["auto"]["plans"]) for r in results}
    assert len(plans) == 1, f"ranks chose differently: {plans}"
    ((chosen, inter, intra),) = plans.pop()
    assert chosen.startswith("qwZ + hpZ int8 + hierarchical reduce + hierarchical gather,"), chosen
    # The norms (32 elements) cost the 12.5 MB/s link less than gloo's fixed cost of a collective.
    assert results[0]["auto"]["configs"][0].keep_whole_numel >= 32
    for r in results:
        auto, manual = r["auto"], r["manual"]
        assert manual["plans"] == []
        for step, (a, b) in enumerate(zip(auto["grads"], manual["grads"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: auto differs from its own Config"
        # The estimate's bytes are those the step sends, link by link (the counter's model).
        assert (auto["inter"], auto["intra"]) == (inter, intra)
        assert "qwZ + hpZ int8" in auto["text"] and "ZeRO-3, buckets" in auto["text"]


def lossy_plan(name: str) -> dict:
    return _train(name, zpp_compile.Config(ranks_per_node=2, plan="auto", allow_lossy=True, lowering="aot_eager",
                                           compute_tflops=1.0, **SLOW_LINKS))  # fmt: skip


def test_allow_lossy_adds_qgz_on_a_slow_link(pools):
    results = pools(4).run(lossy_plan, "gpt")
    for r in results:
        ((name, _, _),) = r["plans"]
        assert name.startswith("qwZ + hpZ int8 + qgZ + hierarchical gather,"), name
        assert r["configs"][0].quantize_gradients and r["inter"] > 0


def budget_run(name: str, budget: int) -> dict:
    return _train(name, zpp_compile.Config(ranks_per_node=2, plan="auto", memory_budget_bytes=budget,
                                           lowering="aot_eager", compute_tflops=1.0, **SLOW_LINKS), steps=1)  # fmt: skip


def test_the_plan_stays_within_the_memory_budget(pools):
    free = pools(4).run(budget_run, "gpt", 2**40)[0]
    # A budget just above the unconstrained plan's compiled bytes but below its estimate: the plan
    # must give something up, and what it compiles stays within the budget.
    budget = free["measured_bytes"][0] + 1
    tight = pools(4).run(budget_run, "gpt", budget)
    for r in tight:
        assert r["plans"][0][0] != free["plans"][0][0]
        assert max(r["measured_bytes"]) <= budget


def too_small_budget() -> tuple[str, bool]:
    model = build("gpt")
    try:
        zpp_compile.shard(model, zpp_compile.Config(ranks_per_node=2, plan="auto", memory_budget_bytes=1000))
    except zpp_compile.ShardingError as e:
        # Refused before any parameter was replaced: the model is as it was, and can be sharded.
        untouched = not zpp_compile.is_sharded(model) and not any(isinstance(p, DTensor) for p in model.parameters())
        return str(e), untouched
    finally:
        reset_process_state()
    return "no error", False


def test_a_budget_below_zero3_is_refused_with_the_figures(pools):
    for message, untouched in pools(4).run(too_small_budget):
        assert "memory_budget_bytes=1000) cannot hold even ZeRO-3" in message
        assert "MB" in message and "Raise memory_budget_bytes to at least" in message
        assert untouched, "a refused budget must leave the model unsharded"


def plan_under_dynamic_shapes() -> tuple:
    """Each rank compiles with another sequence length (symbolic): FLOPs from its own example sizes
    would differ between ranks, so the plan must not depend on them."""
    config = zpp_compile.Config(ranks_per_node=2, plan="auto", lowering="aot_eager", compute_tflops=1.0, **SLOW_LINKS)
    model = zpp_compile.shard(build("gpt"), config)
    compiled = torch.compile(model, backend="zeropp", dynamic=True)
    length = 8 + 2 * dist.get_rank()
    x, y = batch("gpt", 8, 0)
    loss_of("gpt", compiled, x[:2, :length], y[:2, :length]).backward()
    (plan,) = zpp_compile.explain(model).auto_plans
    reset_process_state()
    return plan.chosen.option.name, plan.chosen.step_s


def test_ranks_compiling_other_sizes_under_dynamic_shapes_choose_alike(pools):
    results = pools(4).run(plan_under_dynamic_shapes)
    assert len(set(results)) == 1, results


def test_hpz_without_qwz_keeps_frozen_int8_weights_secondary_int8_and_error_feedback_follows_qgz():
    config = zpp_compile.Config(plan="auto", allow_lossy=True, qgz_error_feedback=True, qgz_error_beta=0.8)
    hpz_only = resolved_config(config, Option(Techniques(hpz=True), 0, 2), TWO_NODES, keep_whole_numel=0)
    assert hpz_only.hpz_size == 2 and hpz_only.hpz_quantized_secondary and not hpz_only.qgz_error_feedback
    assert hpz_only.qgz_error_beta == 0  # the error feedback setting goes with it
    full_secondary = resolved_config(
        config, Option(Techniques(True, True, False, True), 0, 2), TWO_NODES, keep_whole_numel=0
    )
    assert not full_secondary.hpz_quantized_secondary and full_secondary.qgz_error_feedback
    assert full_secondary.qgz_error_beta == 0.8


def plans_after_static_recompile() -> list[str]:
    """The first step has one shape on every rank; the second a shape of each rank's own, compiled
    statically: the recompiled graph must take the first one's plan, not one from its own FLOPs."""
    config = zpp_compile.Config(ranks_per_node=2, plan="auto", lowering="aot_eager", compute_tflops=1.0, **SLOW_LINKS)
    model = zpp_compile.shard(build("gpt"), config)
    compiled = torch.compile(model, backend="zeropp", dynamic=False)
    x, y = batch("gpt", 8, 0)
    for length in (8, 10 + 2 * dist.get_rank()):
        loss_of("gpt", compiled, x[:2, :length], y[:2, :length]).backward()
    names = [p.chosen.option.name for p in zpp_compile.explain(model).auto_plans]
    reset_process_state()
    return names


def test_a_static_recompile_for_other_shapes_keeps_the_first_plan(pools):
    results = pools(4).run(plans_after_static_recompile)
    assert all(len(names) == 2 and len(set(names)) == 1 for names in results), results
    assert len({tuple(names) for names in results}) == 1


def test_a_trial_times_the_best_option_of_each_tied_set_of_techniques_the_estimates_choice_first():
    # 400 Gbit/s links and 10 s of compute: every option ties, so the trial weighs ZeRO-3 (the
    # estimate's choice) and the two fastest other sets' options pick() would take within each.
    facts = dataclasses.replace(FACTS, compute_s=10.0)
    config = zpp_compile.Config(plan="auto", plan_trial_steps=2)
    estimates = [
        estimate(o, facts, TWO_NODES, _cost(400, 400), config, 2**40) for o in options(TWO_NODES, config, True)
    ]
    chosen = pick(estimates)
    candidates = trial_candidates(estimates, chosen)
    assert candidates[0] is chosen and len(candidates) == TRIAL_CANDIDATES
    families = {dataclasses.replace(c.option.techniques, hpz_int8=False) for c in candidates}
    assert len(families) == TRIAL_CANDIDATES  # hpZ's secondary int8 or fp32: one slot
    assert [c.step_s for c in candidates[1:]] == sorted(c.step_s for c in candidates[1:])
    # A slow link between nodes: only the variants of qwZ + hpZ + both hierarchical collectives
    # (the secondary int8 or not) come near the fastest, one family: nothing to time.
    slow = [estimate(o, FACTS, TWO_NODES, _cost(0.1, 10.0), config, 2**40) for o in options(TWO_NODES, config, True)]
    near = [e for e in slow if e.step_s <= min(e.step_s for e in slow) * 1.1]
    assert {e.option.techniques.hpz_int8 for e in near} == {True, False}
    (only,) = trial_candidates(slow, pick(slow))
    t = only.option.techniques
    assert t.quantize_weights and t.hpz and t.hierarchical_reduce and t.hierarchical_gather, only.option.name


def plan_trial_runs(folder: str, runs: int) -> list[dict]:
    """`runs` runs one after the other, as restarts of one job: the first has a plan trial of 1
    step per candidate (each after a warm-up: 6 steps for 3 candidates) on links fast enough that
    every option's estimate ties, then 2 steps under the kept plan; the others 2 steps. What the
    trial keeps is remembered in `folder` (the Inductor cache folder; a fresh one per test)."""
    config = zpp_compile.Config(
        ranks_per_node=2, plan="auto", plan_trial_steps=1, lowering="aot_eager",
        inter_node_gbps=400.0, intra_node_gbps=400.0, compute_tflops=1e-4,
    )  # fmt: skip
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        return [_train("gpt", config, steps=8 if run == 0 else 2) for run in range(runs)]
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        if saved is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def test_a_plan_trial_times_each_candidate_and_every_rank_keeps_the_fastest(pools, tmp_path):
    results = [runs[0] for runs in pools(4).run(plan_trial_runs, str(tmp_path), 1)]
    timed = {tuple(sorted(r["trial_seconds"][0].items())) for r in results}
    assert len(timed) == 1, f"ranks timed the candidates differently: {timed}"
    seconds = results[0]["trial_seconds"][0]
    assert len(seconds) == TRIAL_CANDIDATES and all(s > 0 for s in seconds.values())
    fastest = min(seconds, key=seconds.get)
    for r in results:
        ((kept, _, _),) = r["plans"]
        assert kept == fastest, (kept, seconds)
        # The graph was compiled once per candidate, each under the plan it stands for.
        assert sorted(r["compiled_plans"]) == sorted(seconds)
        assert "timed (median step ms, slowest rank; the fastest kept):" in r["text"]
        # Every step ran: the trial's (each candidate's warm-up and timed step) and the kept plan's.
        assert len(r["grads"]) == 8 and all(torch.isfinite(g).all() for step in r["grads"] for g in step)


def test_a_restarted_job_takes_the_plan_its_trial_kept_without_timing_again(pools, tmp_path):
    for first, restarted in pools(4).run(plan_trial_runs, str(tmp_path), 2):
        ((kept, _, _),) = first["plans"]
        assert restarted["plans"][0][0] == kept
        assert restarted["trial_seconds"] == [{}] and restarted["compiled_plans"] == [kept]  # one compile
        assert "kept by the trial of an earlier run on this machine" in restarted["text"]


def partial_hpz_plan() -> dict:
    free = budget_run("deep_gpt", 2**40)
    # Nine tenths of the way from the leanest plan without hpZ to the leanest with every weight's
    # secondary shard.
    without, every = free["least_added_bytes"][0]
    budget = free["persistent_bytes"][0] + without + (every - without) * 9 // 10
    auto = budget_run("deep_gpt", budget)
    manual = _train("deep_gpt", auto["configs"][0], steps=1)
    return {"free": free, "auto": auto, "manual": manual, "budget": budget}


def test_a_budget_short_of_every_secondary_shard_compiles_hpz_for_some_weights(pools):
    for r in pools(4).run(partial_hpz_plan):
        free, auto, manual = r["free"], r["auto"], r["manual"]
        assert "hpZ" in free["plans"][0][0] and "(hpZ for" not in free["plans"][0][0], free["plans"]
        ((name, inter, intra),) = auto["plans"]
        assert "(hpZ for the backward's first" in name, name
        # The estimate's bytes are those the step sends, link by link.
        assert (auto["inter"], auto["intra"]) == (inter, intra)
        covered = auto["configs"][0].hpz_parameters
        assert covered and all(n.startswith("blocks.") for n in covered), covered
        assert max(auto["measured_bytes"]) <= r["budget"]
        assert all(torch.equal(x, y) for x, y in zip(auto["grads"][0], manual["grads"][0]))


def qwz_but_the_tail_plan(name: str) -> dict:
    # One node of 2 ranks on a 10 Mbit link: qwZ pays, and with no hpZ to gather the tied head
    # again inside a node, sending it once in fp32 beats int8 in the forward plus fp32 in the
    # backward. The slow rate also keeps the head (2048 or 6144 elements) sharded (keep_whole_numel).
    rates = dict(intra_node_gbps=0.01, inter_node_gbps=0.01, compute_tflops=1.0)
    auto = _train(name, zpp_compile.Config(ranks_per_node=2, plan="auto", lowering="aot_eager", **rates))
    return {"auto": auto, "manual": _train(name, auto["configs"][0])}


@pytest.mark.parametrize("name", ["deep_gpt", "hf_gpt2"])
def test_a_plan_leaving_the_tail_out_of_qwz_compiles_it_in_full_precision(pools, name):
    for r in pools(2).run(qwz_but_the_tail_plan, name):
        auto, manual = r["auto"], r["manual"]
        ((chosen, inter, intra),) = auto["plans"]
        assert chosen.startswith("qwZ except the forward's tail, "), chosen
        config = auto["configs"][0]
        assert config.quantize_weights and config.qwz_parameters, config
        # Every sharded weight but the tied embedding / head, whose last read ends the forward.
        prefix = "transformer." if name == "hf_gpt2" else ""
        assert f"{prefix}wte.weight" not in config.qwz_parameters, config.qwz_parameters
        assert f"{prefix}wpe.weight" in config.qwz_parameters and len(config.qwz_parameters) > 8
        # The estimate's bytes are those the step sends; gradients those of the Config it names.
        assert (auto["inter"], auto["intra"]) == (inter, intra)
        for step, (a, b) in enumerate(zip(auto["grads"], manual["grads"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: auto differs from its own Config"
        assert "\n  qwZ, buckets" in auto["text"], auto["text"]
