"""bucket_collectives and schedule_overlap on small lowered graphs (a real one-rank gloo group)."""

import pytest
import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.cost_model import CostModel
from zpp_compile.passes import bucket_collectives, hierarchical_reduce, lower_gather, lower_reduce, schedule_overlap
from zpp_compile.passes.graph_utils import COLLECTIVE_STARTS
from zpp_compile.plan import peak_collective_bytes
from zpp_compile.topology import Topology

from .helpers import context, gathered_layers, trace

c10d = torch.ops._c10d_functional
SLOW_LINK = CostModel(intra_node_bytes_per_s=1e3, inter_node_bytes_per_s=1e3, flops_per_s=1e9)
FAST_LINK = CostModel(intra_node_bytes_per_s=1e15, inter_node_bytes_per_s=1e15, flops_per_s=1e9, latency_s=0.0)


def _three_layers(group: str):
    return gathered_layers(group, 3)


def _order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _kinds(gm) -> list[str]:
    """The graph as a sequence of 'start', 'wait' and 'mm' (other nodes left out)."""
    kinds = {
        **{t: "start" for t in COLLECTIVE_STARTS},
        c10d.wait_tensor.default: "wait",
        torch.ops.aten.mm.default: "mm",
    }
    return [kinds[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in kinds]


def test_bucketing_merges_the_gathers_into_one_and_keeps_values(group_of_one):
    gm, args = _three_layers(group_of_one)
    want = gm(*args)
    gm = bucket_collectives(gm, context(group_of_one))
    assert _kinds(gm).count("start") == 1
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "lowering", [{"inductor_regions": True}, {"lowering": "aot_eager"}], ids=["regions", "aot_eager"]
)
def test_a_bucketed_gather_reads_the_concatenated_shards_not_this_ranks_slot(group_of_one, lowering):
    """Inductor's bucketed gather copies the shards into this rank's slot of the output (a slice
    at rank * n: the rank in the graph) and gathers from there; ours gathers from the concatenation,
    so the graph is the same on every rank, where the collective stays an FX node."""
    gm, args = _three_layers(group_of_one)
    want = gm(*args)
    gm = bucket_collectives(gm, context(group_of_one, **lowering))
    (gather,) = (n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor_out.default)
    assert gather.args[0].target is torch.ops.aten.cat.default
    assert torch.ops.aten.copy_.default not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_a_graph_inductor_compiles_whole_gathers_the_concatenation_out_of_place(group_of_one):
    """Compiled whole, an `_out` gather's wait would not keep the concatenation alive (Inductor's
    memory planner would reuse it while the collective still reads it): the gather becomes the
    out-of-place one, whose input Inductor keeps to the wait, with no rank offset in the graph."""
    gm, args = _three_layers(group_of_one)
    want = gm(*args)
    gm = bucket_collectives(gm, context(group_of_one, inductor_regions=False))
    (gather,) = (n for n in gm.graph.nodes if n.target in COLLECTIVE_STARTS)
    assert gather.target is c10d.all_gather_into_tensor.default
    assert gather.args[0].target is torch.ops.aten.cat.default
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.copy_.default not in targets and torch.ops.aten.empty.memory_format not in targets
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "whole"])
def test_gathers_in_param_dtype_send_the_cast_concatenation(group_of_one, regions):
    """Mixed precision casts each shard before its gather, and Inductor's merge folds those casts
    into its copy of the bucket into this rank's slot (a slice at rank * n). The gather sends the
    cast concatenation instead: no rank offset in the graph, as without casts."""

    def forward(x, *shards):
        for shard in shards:
            w = torch.ops.zpp.gather_param(shard, 4096, [64, 64], 4096, 1, group_of_one, dtype=torch.bfloat16)
            x = torch.tanh(x @ w.float().t())
        return x

    args = (torch.randn(8, 64), *(torch.randn(4096) for _ in range(3)))
    ctx = context(group_of_one, inductor_regions=regions)
    gm = lower_gather(trace(forward, *args), ctx)
    want = gm(*args)
    gm = bucket_collectives(gm, ctx)
    (gather,) = (n for n in gm.graph.nodes if n.target in COLLECTIVE_STARTS)
    sent = gather.args[0]
    assert sent.target is torch.ops.prims.convert_element_type.default and sent.args[1] == torch.bfloat16
    assert sent.args[0].target is torch.ops.aten.cat.default and sent.args[0].meta["val"].dtype == torch.float32
    assert torch.ops.aten.copy_.default not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_gather_bucket_cap_splits_buckets_and_zero_turns_bucketing_off(group_of_one):
    gm, _ = _three_layers(group_of_one)
    two_weights = 2 * 64 * 64 * 4
    assert _kinds(bucket_collectives(gm, context(group_of_one, gather_bucket_bytes=two_weights))).count("start") == 2
    gm, _ = _three_layers(group_of_one)
    code = gm.code
    assert bucket_collectives(gm, context(group_of_one, gather_bucket_bytes=0)).code == code


def test_reduce_scatters_are_bucketed_too(group_of_one):
    def backward(a, b):
        return [torch.ops.zpp.reduce_grad(g * 2, g.numel(), g.numel(), 1, group_of_one) for g in (a, b)]

    args = (torch.randn(100), torch.randn(30))
    gm = lower_reduce(trace(backward, *args), context(group_of_one, phase="backward"))
    want = gm(*args)
    gm = bucket_collectives(gm, context(group_of_one, phase="backward"))
    assert _kinds(gm).count("start") == 1
    for got, expected in zip(gm(*args), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_before_scheduling_each_gather_is_waited_where_it_starts(group_of_one):
    gm, _ = _three_layers(group_of_one)
    assert _kinds(gm) == ["start", "wait", "mm"] * 3


def test_slow_link_prefetches_the_next_gathers_behind_compute(group_of_one):
    gm, args = _three_layers(group_of_one)
    want = gm(*args)
    before = peak_collective_bytes(gm)
    gm = schedule_overlap(gm, context(group_of_one, cost_model=SLOW_LINK, prefetch_limit=2))
    # Transfers never hide on this link, so each gather goes as early as the limits allow: two in
    # flight, so the third starts once the first has arrived, and runs behind the first layer.
    assert _kinds(gm) == ["start", "start", "wait", "start", "mm", "wait", "mm", "wait", "mm"]
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert peak_collective_bytes(gm) == 3 * before  # the weight in use + two in flight


def test_prefetch_limit_bounds_the_gathers_in_flight(group_of_one):
    gm, _ = _three_layers(group_of_one)
    gm = schedule_overlap(gm, context(group_of_one, cost_model=SLOW_LINK, prefetch_limit=1))
    # One in flight: the next gather starts only once the previous one has been waited for.
    assert _kinds(gm) == ["start", "wait", "start", "mm", "wait", "start", "mm", "wait", "mm"]
    assert peak_collective_bytes(gm) == 2 * 64 * 64 * 4


def test_prefetch_bytes_bounds_the_bytes_in_flight(group_of_one):
    gm, _ = _three_layers(group_of_one)
    weight = 64 * 64 * 4
    gm = schedule_overlap(gm, context(group_of_one, cost_model=SLOW_LINK, prefetch_limit=8, prefetch_bytes=weight))
    # One weight's bytes in flight: as a limit of one collective here.
    assert _kinds(gm) == ["start", "wait", "start", "mm", "wait", "start", "mm", "wait", "mm"]
    assert peak_collective_bytes(gm) == 2 * weight


def test_fast_link_needs_no_prefetch_and_keeps_memory_at_one_weight(group_of_one):
    gm, _ = _three_layers(group_of_one)
    gm = schedule_overlap(gm, context(group_of_one, cost_model=FAST_LINK))
    assert _kinds(gm) == ["start", "wait", "mm"] * 3
    assert peak_collective_bytes(gm) == 64 * 64 * 4


def test_without_a_cost_model_the_order_is_left_alone(group_of_one):
    gm, _ = _three_layers(group_of_one)
    order = _order(gm)
    assert _order(schedule_overlap(gm, context(group_of_one, cost_model=None))) == order


def test_a_sunk_wait_takes_along_the_buffers_its_unpacking_writes_into(group_of_one):
    """On CUDA the dequantize after a gather is a Triton kernel writing into an `empty` buffer that
    may sit below the wait's first other user; sinking the unpacking chain must move the buffer
    too (a GPU run failed lint with 'empty_95 used before it has been defined')."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    start = graph.call_function(c10d.all_gather_into_tensor.default, (x, 1, group_of_one))
    wait = graph.call_function(c10d.wait_tensor.default, (start,))
    first_use = graph.call_function(torch.ops.aten.add.Tensor, (wait, y))  # needs more than the wait
    buffer = graph.call_function(torch.ops.aten.empty.memory_format, ([4],), {"dtype": torch.float32})
    unpacked = graph.call_function(torch.ops.aten.copy.default, (buffer, wait))  # only the wait and a buffer
    total = graph.call_function(torch.ops.aten.add.Tensor, (unpacked, first_use))
    graph.output((total,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    args = (torch.randn(4), torch.randn(4))
    want = _run_recording_values(gm, args)
    gm = schedule_overlap(gm, context(group_of_one, cost_model=SLOW_LINK, prefetch_limit=2))
    gm.graph.lint()  # every node after its inputs
    order = _order(gm)
    assert order.index(buffer.name) < order.index(unpacked.name) < order.index(first_use.name)
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def _two_blocks_reduced_hierarchically(group: str) -> torch.fx.GraphModule:
    """Two gradients, each reduced (hierarchical_reduce, a bucket each) once computed, then
    scheduled on links where transfers take no time; both stages on `group` (one rank: the order
    is what is checked)."""
    topology = Topology(4, 1, 2, group, node_group_name=group, cross_node_group_name=group)

    def reduce(grad):
        return torch.ops.zpp.reduce_grad(grad, grad.numel(), grad.numel() // 4, 4, group)

    def backward(x, w):
        first = x @ w
        reduced = reduce(first)  # a block's gradients complete: its bucket is reduced here
        return [reduced, reduce(first @ w @ w)]

    gm = trace(backward, torch.randn(64, 64), torch.randn(64, 64))
    ctx = context(topology, phase="backward", hierarchical_reduce=True, reduce_bucket_bytes=0, cost_model=FAST_LINK)
    return schedule_overlap(hierarchical_reduce(gm, ctx), ctx)


def test_a_two_stage_reduce_sends_each_bucket_on_before_the_next_compute(group_of_one):
    """hierarchical_reduce's in-node sums feed its cross-node all-to-all. The in-node wait must not
    sink to the graph's end with the second stage in tow: every cross-node transfer then waited
    for the whole backward (on the 100 Mbit cluster the link sat idle for the backward's first
    160 ms, and a step took 1.1 s instead of 0.83)."""
    gm = _two_blocks_reduced_hierarchically(group_of_one)
    # Per gradient: the first stage, its wait, the second stage; only the second stage's waits
    # sink (nothing in a backward reads a reduced gradient).
    assert _kinds(gm) == ["mm", "start", "wait", "start", "mm", "mm", "start", "wait", "start", "wait", "wait"]


def _run_recording_values(gm: torch.fx.GraphModule, args: tuple) -> object:
    """Run `gm`, keeping each node's value in node.meta["val"] as traced graphs have it."""

    class Recording(torch.fx.Interpreter):
        def run_node(self, node):
            node.meta["val"] = result = super().run_node(node)
            return result

    return Recording(gm).run(*args)
