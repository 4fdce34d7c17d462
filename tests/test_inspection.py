"""What the user can inspect: saved tensors, the communication counter, explain(), graph dumps."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zpp_compile
from zpp_compile import passes
from zpp_compile.backend import compiled_graphs
from zpp_compile.layout import shard_spec

from .models import OddMLP, batch, build, loss_of

# Full weight numels of OddMLP: fc1 29x13, frozen 29x29, fc2 7x29; no activation has these sizes.
FULL_WEIGHT_NUMELS = {29 * 13, 29 * 29, 7 * 29}


def _one_compiled_step(config: zpp_compile.Config):
    torch.manual_seed(0)
    model = zpp_compile.shard(OddMLP(), config)
    x, y = batch("mlp", 2, 0)
    F.mse_loss(torch.compile(model, backend="zeropp")(x), y).backward()
    return model


def saved_numels(save_gathered_weights: bool, keep_last: bool = False) -> list[list[int]]:
    config = zpp_compile.Config(save_gathered_weights=save_gathered_weights, keep_last_weights_gathered=keep_last)
    _one_compiled_step(config)
    return [[t.numel() for t in record.saved_for_backward] for record in compiled_graphs()]


def backward_gathers(keep_last: bool) -> list[int]:
    # One gather per weight, to count.
    _one_compiled_step(zpp_compile.Config(gather_bucket_bytes=0, keep_last_weights_gathered=keep_last))
    c10d = torch.ops._c10d_functional
    return [
        sum(n.target == c10d.all_gather_into_tensor.default for n in record.backward.graph.nodes)
        for record in compiled_graphs()
    ]


def test_no_gathered_weight_is_saved_for_backward(pools):
    for per_graph in pools(2).run(saved_numels, False)[0]:
        assert not FULL_WEIGHT_NUMELS & set(per_graph), per_graph


def test_the_saved_weight_check_can_see_a_saved_weight(pools):
    # Control: when the config allows saving gathered weights, the same inspection finds them.
    saved = pools(2).run(saved_numels, True)[0]
    assert any(FULL_WEIGHT_NUMELS & set(per_graph) for per_graph in saved), saved


def test_the_last_weight_read_is_kept_for_backward_in_a_model_without_blocks(pools):
    # OddMLP has no repeated block: only fc2's weight, the forward's last read, is saved.
    for per_graph in pools(2).run(saved_numels, False, True)[0]:
        assert FULL_WEIGHT_NUMELS & set(per_graph) == {7 * 29}, per_graph


def test_backward_regathers_the_weights_it_needs(pools):
    # frozen.weight and fc2.weight are needed for input gradients; fc1's are not (x needs no grad),
    # and the 0-d scale is replicated (nothing to gather). Kept from forward: fc2's.
    assert [pools(2).run(backward_gathers, keep_last)[0] for keep_last in (False, True)] == [[2], [1]]


def counted_bytes(mode: str, bucket_bytes: int = 0) -> dict:
    """One step on 2 simulated nodes x 2 ranks: counter figures and the sizes they must equal."""
    torch.manual_seed(0)
    config = zpp_compile.Config(ranks_per_node=2, gather_bucket_bytes=bucket_bytes, reduce_bucket_bytes=bucket_bytes)
    model = zpp_compile.shard(OddMLP(), config)
    sharded = [p for p in model.parameters() if p.dim()]  # the 0-d scale is replicated, not gathered
    shard_bytes = sum(shard_spec(p).shard_numel * p.element_size() for p in sharded)
    trainable_shard_bytes = sum(shard_spec(p).shard_numel * p.element_size() for p in sharded if p.requires_grad)
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    x, y = batch("mlp", 8, 0)
    counter = zpp_compile.comm_counter()
    counter.reset()
    F.mse_loss(run(x.chunk(4)[dist.get_rank()]), y.chunk(4)[dist.get_rank()]).backward()
    return {
        "shard_bytes": shard_bytes,
        "trainable_shard_bytes": trainable_shard_bytes,
        "fw_gather_intra": counter.bytes(phase="forward", op="all_gather", locality="intra"),
        "fw_gather_inter": counter.bytes(phase="forward", op="all_gather", locality="inter"),
        "fw_gather_received": counter.bytes("received", phase="forward", op="all_gather"),
        "rs_intra": counter.bytes(phase="backward", op="reduce_scatter", locality="intra"),
        "rs_inter": counter.bytes(phase="backward", op="reduce_scatter", locality="inter"),
        "rs_calls": counter.calls(op="reduce_scatter"),
        "all_reduce_calls": counter.calls(op="all_reduce"),
        "fw_gather_calls": counter.calls(phase="forward", op="all_gather"),
    }


def _check_zero3_volume(c: dict, gathers: int = 6, reduce_scatters: int = 4) -> None:
    # 4 ranks on 2 nodes: each rank has 1 peer on its node and 2 on the other.
    assert c["fw_gather_intra"] == c["shard_bytes"]
    assert c["fw_gather_inter"] == 2 * c["shard_bytes"]
    assert c["fw_gather_received"] == 3 * c["shard_bytes"]
    assert c["rs_intra"] == c["trainable_shard_bytes"]
    assert c["rs_inter"] == 2 * c["trainable_shard_bytes"]
    assert c["fw_gather_calls"] == gathers  # unbucketed: 6 sharded parameters, the frozen ones included
    assert c["rs_calls"] == reduce_scatters  # unbucketed: only trainable parameters get gradients
    assert c["all_reduce_calls"] == 1  # the replicated scale's gradient


def test_counter_matches_zero3_volume_eager(pools):
    for c in pools(4).run(counted_bytes, "eager"):
        _check_zero3_volume(c)


def test_counter_matches_zero3_volume_compiled(pools):
    for c in pools(4).run(counted_bytes, "compiled"):
        _check_zero3_volume(c)


def test_bucketing_moves_the_same_bytes_in_one_collective_each_way(pools):
    for c in pools(4).run(counted_bytes, "compiled", 2**20):
        _check_zero3_volume(c, gathers=1, reduce_scatters=1)


def tied_weight_collectives() -> tuple[int, int, int]:
    """(forward all-gathers, backward reduce-scatters, parameters) of one compiled GPT step."""
    torch.manual_seed(0)
    model = zpp_compile.shard(build("gpt"), zpp_compile.Config(gather_bucket_bytes=0, reduce_bucket_bytes=0))
    counter = zpp_compile.comm_counter()
    counter.reset()
    x, y = batch("gpt", 2 * dist.get_world_size(), 0)
    loss_of("gpt", torch.compile(model, backend="zeropp"), x[:2], y[:2]).backward()
    gathers, reduces = counter.calls(phase="forward", op="all_gather"), counter.calls(op="reduce_scatter")
    return gathers, reduces, len(list(model.parameters()))


def test_tied_weight_is_gathered_once_and_reduced_once(pools):
    # GPT's wte and lm_head share one Parameter: Dynamo's graph reads it twice, dedupe_gathers
    # must leave one gather, so autograd sums both uses before a single reduce-scatter.
    gathers, reduces, params = pools(2).run(tied_weight_collectives)[0]
    assert gathers == reduces == params


def explain_vs_counter() -> tuple[str, int, int, int, int, bool]:
    torch.manual_seed(0)
    model = zpp_compile.shard(OddMLP(), zpp_compile.Config(ranks_per_node=1))
    x, _ = batch("mlp", 4, 0)
    plan = zpp_compile.explain(model, x)
    grads_untouched = all(p.grad is None for p in model.parameters())
    counter = zpp_compile.comm_counter()
    counter.reset()
    torch.compile(model, backend="zeropp")(x).sum().backward()
    return (
        str(plan),
        plan.bytes(),
        counter.bytes(),
        plan.bytes(locality="inter"),
        plan.count(op="reduce_scatter"),
        grads_untouched,
    )


def test_explain_lists_the_collectives_of_one_step(pools):
    text, plan_bytes, counted, inter, reduce_scatters, grads_untouched = pools(2).run(explain_vs_counter)[0]
    assert "all_gather" in text and "reduce_scatter" in text and "float32" in text
    assert plan_bytes == counted > 0
    assert inter == plan_bytes  # ranks_per_node=1: every peer is on another node
    assert reduce_scatters == 1  # the 4 sharded trainable gradients share one default-size bucket
    assert grads_untouched


def dump_graphs(folder: str) -> list[str]:
    _one_compiled_step(zpp_compile.Config(dump_graphs_dir=folder, lowering="aot_eager"))
    return sorted(os.listdir(os.path.join(folder, f"rank{dist.get_rank()}")))


def test_graphs_are_dumped_before_and_after_every_pass(pools, tmp_path):
    names = pools(2).run(dump_graphs, str(tmp_path))[0]
    graph = names[0].split("_")[0]  # graph ids count up per process: "graph<N>"
    pipelines = {
        "dynamo": passes.PRE_AUTOGRAD_PASSES,
        "joint": passes.JOINT_PASSES,
        "forward": passes.FORWARD_PASSES,
        "backward": passes.BACKWARD_PASSES,
    }
    for phase, pipeline in pipelines.items():
        stages = ["input"] + [p.__name__ for p in pipeline]
        for i, stage in enumerate(stages):
            assert f"{graph}_{phase}_{i:02d}_{stage}.txt" in names, names
    last_backward = f"{len(passes.BACKWARD_PASSES):02d}_{passes.BACKWARD_PASSES[-1].__name__}"
    text = (tmp_path / "rank1" / f"{graph}_backward_{last_backward}.txt").read_text()
    assert "reduce_scatter_tensor" in text and "= torch.ops.zpp." not in text  # no marker call left
    assert "zpp.gather_param" in (tmp_path / "rank1" / f"{graph}_forward_00_input.txt").read_text()
