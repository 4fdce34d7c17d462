"""inductor_regions: a lowered graph compiled by Inductor one run between collectives at a time,
identical runs compiled once (a real one-rank gloo group, real Inductor)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch._inductor.compile_fx import compile_fx_inner
from torch.fx.experimental.proxy_tensor import make_fx

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.compile_timing import fx_graph_cache_counts
from zpp_compile.inductor_regions import compile_regions, cut_region, runs_between_collectives
from zpp_compile.passes import (
    bucket_collectives,
    compiled_whole_reason,
    cuts_at_blocks,
    lower_gather,
    tag_parameter_inputs,
)
from zpp_compile.passes.buckets import block_of_name
from zpp_compile.passes.graph_utils import COLLECTIVE_STARTS

from .passes.helpers import context, gathered_layers, gathering_layers

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _layers(group: str, layers: int):
    """gathered_layers with Inductor's decompositions applied, as AOTAutograd hands graphs over."""
    from torch._inductor.decomposition import select_decomp_table

    gm, args = gathered_layers(group, layers)
    return make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args), args


def _region_calls(compiled_gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in compiled_gm.graph.nodes if n.name.startswith("region_")]


def test_each_run_between_collectives_is_one_region_and_the_values_stay(group_of_one):
    gm, args = _layers(group_of_one, 3)
    want = gm(*args)
    runs = runs_between_collectives(gm.graph)
    # After each gather's wait: a layer (view the weight, mm, tanh).
    assert [[str(n.target) for n in run] for run in runs] == [
        ["aten.view.default", "aten.permute.default", "aten.mm.default", "aten.tanh.default"]
    ] * 3
    compiled = compile_regions(gm, compile_fx_inner)
    assert len(_region_calls(gm)) == 3
    # The collectives and waits stay in the outer graph, in their order.
    outer = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_STARTS]
    assert len(outer) == 3
    torch.testing.assert_close(compiled(list(args)), want)


def test_a_region_input_is_freed_at_its_last_read_not_when_the_region_returns(group_of_one):
    """The outer graph hands each region its inputs in a list and keeps no other reference to
    those it does not read again: a region (Inductor's code, here a stand-in that empties the list
    as Inductor's does) can free them after its last kernel."""

    def fn(x, w):  # x: read by the first region only; w: by the first and the second
        reduced = c10d.wait_tensor(c10d.all_reduce(torch.tanh(x) + w, "sum", group_of_one))
        return (reduced * w,)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(8))
    alive_after_clearing: list[list[bool]] = []

    def compile_region(graph, fake_inputs):
        def run(inputs):
            held = [weakref.ref(t) for t in inputs]
            outputs = graph(*inputs)
            inputs.clear()
            alive_after_clearing.append([ref() is not None for ref in held])
            return outputs

        return run

    compiled = compile_regions(gm, compile_region)
    compiled([torch.randn(8), torch.randn(8)])
    assert alive_after_clearing[0] == [False, True]  # x is gone inside the region; w is read later


def test_what_is_computed_from_no_input_is_computed_in_its_readers_region(group_of_one):
    """An index made from an iota above a collective's wait (where a pass traced it in) goes into
    the region that reads it: cut into the region before, it crossed the cut as a real tensor
    (two int64 tensors of the embedding's size under full ZeRO++ on GPT-2)."""

    def fn(x):
        index = torch.arange(64) % 16  # read only after the collective
        reduced = c10d.wait_tensor(c10d.all_reduce(torch.tanh(x), "sum", group_of_one))
        return (reduced[index] * 2,)

    from torch._inductor.decomposition import select_decomp_table

    x = torch.randn(16)
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(x)
    want = fn(x)
    region_inputs: list[list[torch.dtype]] = []

    def compile_region(graph, fake_inputs):
        region_inputs.append([t.dtype for t in fake_inputs])
        return compile_fx_inner(graph, fake_inputs)

    compiled = compile_regions(gm, compile_region)
    assert torch.int64 not in {dtype for inputs in region_inputs for dtype in inputs}
    torch.testing.assert_close(compiled([x])[0], want[0])


def test_rows_written_in_place_between_regions_reach_the_next_region(group_of_one):
    """fold_scatter_grads' zpp.add_rows writes into a matmul result one region returns; it runs
    between regions (a boundary), and the region after it reads the written tensor. With real
    Inductor, whose code also empties each region's input list."""
    from torch._inductor.decomposition import select_decomp_table

    from zpp_compile.passes import fold_scatter_grads

    vocab, width = 20, 8

    def fn(hidden, grad_logits, index, rows):
        head = grad_logits.t() @ hidden
        scale = c10d.wait_tensor(c10d.all_reduce(rows.sum(), "sum", group_of_one))
        summed = head + aten.embedding_dense_backward(rows, index, vocab, -1, False)
        return (summed * scale,)

    torch.manual_seed(0)
    args = [torch.randn(6, width), torch.randn(6, vocab), torch.randint(0, vocab, (2, 5)), torch.randn(2, 5, width)]
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    ctx = dataclasses.replace(context(group_of_one, phase="backward"), decompositions=select_decomp_table())
    gm = fold_scatter_grads(gm, ctx)
    assert torch.ops.zpp.add_rows.default in {n.target for n in gm.graph.nodes}
    left_in_list: list[int] = []

    def compile_region(graph, fake_inputs):
        compiled = compile_fx_inner(graph, fake_inputs)

        def run(inputs):
            outputs = compiled(inputs)
            left_in_list.append(len(inputs))
            return outputs

        return run

    compiled = compile_regions(gm, compile_region)
    assert torch.ops.zpp.add_rows.default in {n.target for n in gm.graph.nodes}  # in the outer graph
    torch.testing.assert_close(compiled(list(args))[0], fn(*args)[0])
    assert left_in_list and set(left_in_list) == {0}


def test_identical_layers_compile_once(group_of_one):
    gm, args = _layers(group_of_one, 4)
    want = gm(*args)
    regions = [cut_region(gm, run) for run in runs_between_collectives(gm.graph)]
    assert all(r is not None for r in regions)
    assert len({r.graph.code for r in regions}) == 1  # canonical names: four copies of one graph
    lookups = _fx_graph_cache_lookups()
    compiled = compile_regions(gm, compile_fx_inner)
    assert _fx_graph_cache_lookups() - lookups == 1  # the other three reuse what it compiled
    assert len(_region_calls(gm)) == 4
    torch.testing.assert_close(compiled(list(args)), want)


def _fx_graph_cache_lookups() -> int:
    return sum(fx_graph_cache_counts())


def test_a_run_of_views_only_stays_fx(group_of_one):
    def forward(x, shard):
        w = torch.ops.zpp.gather_param(shard, 64 * 64, [64, 64], 64 * 64, 1, group_of_one)
        return w.t(), x

    gm = lower_gather(make_fx(forward, tracing_mode="fake")(torch.randn(4), torch.randn(4096)), context(group_of_one))
    (run,) = runs_between_collectives(gm.graph)
    assert cut_region(gm, run) is None


def test_a_graph_with_symbolic_shapes_is_compiled_whole(group_of_one):
    def forward(x):
        return torch.tanh(x) * x.shape[0]

    gm = make_fx(forward, tracing_mode="symbolic")(torch.randn(8, 4))
    by_region = context(group_of_one, inductor_regions=True)
    assert "symbolic shape" in compiled_whole_reason(gm, by_region)
    static, _ = gathered_layers(group_of_one, layers=1)
    assert compiled_whole_reason(static, by_region) is None


def test_a_bucket_never_spans_two_blocks(group_of_one):
    """Three gathers fit one bucket, but the first two serve block h.0 and the third h.1."""
    # The shards are graph inputs 1-3 (what tag_parameter_inputs records on each gather).
    ctx = dataclasses.replace(
        context(group_of_one, inductor_regions=True),
        parameter_names=("h.0.w", "h.0.v", "h.1.w"),
        parameter_positions=(1, 2, 3),
    )
    traced, args = gathering_layers(group_of_one, 3)
    gm = lower_gather(tag_parameter_inputs(traced, ctx), ctx)
    want = gm(*args)
    gm = bucket_collectives(gm, ctx)
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_STARTS]
    sizes = [n.args[0].meta["val"].numel() for n in gathers]
    assert sizes == [2 * 4096, 4096], sizes
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_graphs_are_cut_by_block_from_four_blocks_on_unless_the_config_says(group_of_one):
    def cut(names, **config):
        return cuts_at_blocks(dataclasses.replace(context(group_of_one, **config), parameter_names=names))

    four = tuple(f"h.{i}.w" for i in range(4))
    assert cut(four) and not cut(four[:3]) and not cut(("wte.weight", "lm_head.weight"))
    assert cut(four[:2], inductor_regions=True) and not cut(four, inductor_regions=False)


def test_block_of_a_parameter_is_its_name_up_to_the_first_index():
    assert block_of_name("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert block_of_name("model.layers.10.mlp.up_proj.weight") == "model.layers.10"
    assert block_of_name("transformer.wte.weight") == ""


def _train_steps(model_name: str, steps: int, regions: bool, config: dict) -> dict:
    """Losses and final gradients of `steps` Inductor-compiled steps, graphs compiled by region
    (or whole), with the FX-graph cache's outcomes of the regions."""
    import torch.distributed as dist

    from .models import batch, build, loss_of
    from .workers import reset_process_state

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        torch.manual_seed(0)
        model = zpp_compile.shard(build(model_name), zpp_compile.Config(inductor_regions=regions, **config))
        compiled = torch.compile(model, backend="zeropp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = batch(model_name, 2 * world, step)
            opt.zero_grad()
            loss = loss_of(model_name, compiled, x.chunk(world)[rank], y.chunk(world)[rank])
            loss.backward()
            losses.append(loss.item())
            if step < steps - 1:
                opt.step()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        record = zpp_compile.compiled_graphs()[0]
        regions = [n.name for n in record.forward.graph.nodes if n.name.startswith("region_")]
        return {"losses": losses, "grads": grads, "cache": dict(record.inductor_cache), "in_record": regions}
    finally:
        reset_process_state()


@pytest.mark.parametrize(
    "model_name, config",
    [("hf_gpt2_dropout", {"ranks_per_node": 1, "quantize_weights": True, "quantize_gradients": True}), ("conv", {})],
    ids=["hf_gpt2_full_zeropp", "conv_zero3"],
)
def test_regions_train_as_the_whole_graph_does_on_a_model_we_did_not_write(pools, model_name, config):
    """HF GPT-2 with dropout (2 blocks), full ZeRO++ on 2 simulated nodes; convolutions, which
    Inductor lays out channels-last when it compiles them whole (regions must not: each region
    takes its inputs in the traced strides). Compiled by region, the losses and gradients are those
    of the whole-graph compile; the recorded graph is the rewritten one, not the region-cut copy."""
    by_region = pools(2).run(_train_steps, model_name, 2, True, config)
    whole = pools(2).run(_train_steps, model_name, 2, False, config)
    for got, want in zip(by_region, whole):
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert got["in_record"] == [], "compiled_graphs() must keep the graph the passes made"
        assert set(got["cache"]) == {"forward", "backward"}
