import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.codegen.quantize import payload_numel
from zpp_compile.passes import hpz
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
    assert saved.target == torch.ops.zpp.owned_copy.default and saved.meta["val"].shape == (132,)
    piece = saved.args[0]
    assert piece.target == torch.ops.aten.slice.Tensor and piece.args[2:] == (132, 264)  # rank 1 keeps [132, 264)
    (gather,) = [n for n in bw.graph.nodes if n.target == torch.ops.zpp.gather_param.default]
    assert gather.args[3:] == (132, 2, "hpz_01")
    assert gather.args[0].op == "placeholder" and gather.args[0].meta["val"].shape == (132,)


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
