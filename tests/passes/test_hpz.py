import dataclasses

import pytest
import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.codegen.quantize import payload_numel
from zpp_compile.passes import bucket_collectives, hpz, qwz, tag_parameter_inputs
from zpp_compile.passes.graph_utils import COLLECTIVE_STARTS
from zpp_compile.passes.tag_parameter_inputs import PARAM_INPUT
from zpp_compile.topology import Topology

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional
# Rank 1 of 4, two nodes of two, hpZ groups {0, 1} and {2, 3}: this rank keeps the second half.
TOPOLOGY = Topology(
    world_size=4, rank=1, ranks_per_node=2, world_group_name="world", hpz_size=2, hpz_group_name="hpz_01"
)


def _partitioned_pair():
    """A forward that saves the primary shard and a backward that re-gathers it (as min-cut does)."""

    def forward(shard, x):
        w = torch.ops.zpp.gather_param(shard, 198, [9, 22], 66, 4, "world")  # 9 rows -> 4 chunks of 3 (66)
        return x @ w.t(), shard, x

    def backward(shard, x, tangent):
        return tangent @ torch.ops.zpp.gather_param(shard, 198, [9, 22], 66, 4, "world")

    shard, x = torch.randn(3, 22), torch.randn(3, 22)
    return trace(forward, shard, x), trace(backward, shard, x, torch.randn(3, 9))


def _run_hpz(**config):
    ctx = context(TOPOLOGY, phase="partitioned", hpz_size=2, **config)
    return hpz(*_partitioned_pair(), ctx)


def test_forward_saves_its_half_of_the_weight_and_backward_gathers_in_node():
    fw, bw = _run_hpz()
    saved = fw.graph.output_node().args[0][1]
    assert saved.target == torch.ops.zpp.owned_slot.default and saved.meta["val"].shape == (132,)
    # Half of the padded weight (264 = 4 x 66): the slot of this rank in the hpZ group, found when
    # it runs (no rank in the graph).
    assert saved.args[0].meta["val"].shape == (264,) and saved.args[1:] == (2, "hpz_01")
    (gather,) = [n for n in bw.graph.nodes if n.target == torch.ops.zpp.gather_param.default]
    assert gather.args[3:] == (132, 2, "hpz_01")
    assert gather.args[0].op == "placeholder" and gather.args[0].meta["val"].shape == (132,)


@pytest.mark.parametrize("config", [{}, {"quantize_weights": True, "weight_block_size": 64}], ids=["fp32", "int8"])
def test_the_ranks_of_an_hpz_group_get_the_same_graphs(config):
    """No rank offset in the graphs (passes/README.md, invariant 8): the ranks of a node compile
    them once between them (compile_sharing)."""
    codes = []
    for rank in (0, 1):
        ctx = context(dataclasses.replace(TOPOLOGY, rank=rank), phase="partitioned", hpz_size=2, **config)
        codes.append(tuple(gm.code for gm in hpz(*_partitioned_pair(), ctx)))
    assert codes[0] == codes[1]


def test_with_qwz_the_secondary_is_this_ranks_slice_of_the_gathered_int8_payloads():
    fw, bw = _run_hpz(quantize_weights=True, weight_block_size=64)
    assert torch.ops.zpp.gather_param.default not in targets(fw), "the forward gather is quantized here"
    (gather,) = [n for n in fw.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    assert gather.args[0].meta["val"].dtype == torch.int8
    saved = fw.graph.output_node().args[0][1]
    assert saved.meta["val"].dtype == torch.int8
    assert saved.meta["val"].numel() == 2 * payload_numel(66, 64)  # 2 of the 4 ranks' payloads
    (regather,) = [n for n in bw.graph.nodes if n.target == torch.ops.zpp.gather_quantized_param.default]
    assert regather.args[1:] == (198, [9, 22], 66, 64, torch.float32, 2, "hpz_01")


def test_graphs_are_unchanged_without_hpz():
    fw, bw = _partitioned_pair()
    code = fw.code, bw.code
    ctx = context(Topology(4, 1, 2, "world"), phase="partitioned")
    fw, bw = hpz(fw, bw, ctx)
    assert (fw.code, bw.code) == code


def _blocks_pair(blocks: int, group: str):
    """A forward of `blocks` layers, each a gathered weight (re-gathered by the backward) and a
    gathered bias, and that backward; the shards are inputs 1, 2, 3, ... of both. Gathers over 4
    ranks of `group` (bucketing looks the group up; nothing here runs)."""

    def forward(x, *shards):
        for weight, bias in zip(shards[::2], shards[1::2]):
            w = torch.ops.zpp.gather_param(weight, 64 * 64, [64, 64], 1024, 4, group)
            x = torch.tanh(x @ w.t() + torch.ops.zpp.gather_param(bias, 64, [64], 16, 4, group))
        return x, *shards[::2]

    def backward(tangent, *weights):
        return [tangent @ torch.ops.zpp.gather_param(w, 64 * 64, [64, 64], 1024, 4, group) for w in weights]

    shards = [torch.randn(n) for _ in range(blocks) for n in (1024, 16)]
    return trace(forward, torch.randn(8, 64), *shards), trace(backward, torch.randn(8, 64), *shards[::2])


def test_with_qwz_the_inlined_forward_gather_keeps_the_parameter_it_serves():
    """The int8 path replaces the marker by an inlined gather: it carries the marker's tag, which
    bucketing needs to keep blocks apart."""
    fw, bw = _partitioned_pair()
    (marker,) = [n for n in fw.graph.nodes if n.target == torch.ops.zpp.gather_param.default]
    marker.meta["custom"] = {PARAM_INPUT: 0}
    fw, _ = hpz(fw, bw, context(TOPOLOGY, phase="partitioned", hpz_size=2, quantize_weights=True))
    (gather,) = [n for n in fw.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    assert gather.meta["custom"] == {PARAM_INPUT: 0}


def test_with_qwz_each_blocks_forward_gathers_travel_as_one_bucket(group_of_one):
    """Four blocks of a weight (its int8 secondary kept for backward, so hpz inlines its gather) and
    a bias (gathered by qwz): one all-gather per block, as under ZeRO-3. Untagged, the weights'
    gathers fell out of their blocks' buckets: 8 collectives, and regions that differed by block."""
    names = tuple(f"h.{i}.{kind}" for i in range(4) for kind in ("weight", "bias"))
    topology = dataclasses.replace(TOPOLOGY, world_group_name=group_of_one, hpz_group_name=group_of_one)
    ctx = dataclasses.replace(
        context(topology, phase="partitioned", hpz_size=2, quantize_weights=True, inductor_regions=True),
        parameter_names=names,
        parameter_positions=tuple(range(1, 9)),
    )
    fw, bw = _blocks_pair(4, group_of_one)
    fw, _ = hpz(tag_parameter_inputs(fw, ctx), bw, ctx)
    fw = bucket_collectives(qwz(fw, ctx), ctx)
    gathers = [n for n in fw.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_STARTS]
    assert len(gathers) == 4, [n.args[0].meta["val"].shape for n in gathers]
