import pytest
import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.codegen.int4 import chunk_payload_numel
from zpp_compile.passes import PassContext, qgz
from zpp_compile.topology import Topology

from .helpers import call_targets_with_triton_kernels, context, targets, trace

c10d = torch.ops._c10d_functional


def _reduce_graph(group_name: str, world: int):
    def backward(grad):
        return torch.ops.zpp.reduce_grad(grad, 1000, 1000 // world, world, group_name)

    return trace(backward, torch.randn(40, 25))


def _context(topology: Topology, **config) -> PassContext:
    return context(topology, phase="backward", quantize_gradients=True, gradient_block_size=64, **config)


def test_two_nodes_get_an_int4_all_to_all_in_the_node_then_one_across():
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
    gm = qgz(_reduce_graph("world", 4), _context(topology))
    assert torch.ops.zpp.reduce_grad.default not in targets(gm)
    all_to_alls = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert [n.args[-1] for n in all_to_alls] == ["node_0", "local_1"]
    payload = chunk_payload_numel(256, 64)  # shard 250 -> one chunk of 4 blocks of 64
    assert [n.args[0].meta["val"].numel() for n in all_to_alls] == [2 * 2 * payload, 2 * payload]
    assert {n.args[0].meta["val"].dtype for n in all_to_alls} == {torch.uint8}
    (result,) = gm.graph.output_node().args
    assert result.meta["val"].shape == (250,)


def test_error_feedback_adds_a_load_and_a_store_per_stage():
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
    gm = qgz(_reduce_graph("world", 4), _context(topology, qgz_error_feedback=True, qgz_error_beta=0.5))
    assert targets(gm).count(torch.ops.zpp.ef_load.default) == 2
    stores = [n for n in gm.graph.nodes if n.target == torch.ops.zpp.ef_store.default]
    assert len(stores) == 2
    assert [n.args[2] for n in stores] == [0.5] * 2  # Config.qgz_error_beta


def test_one_rank_per_node_skips_the_in_node_stage():
    topology = Topology(4, 1, 1, "world", node_group_name="self_1", cross_node_group_name="world")
    gm = qgz(_reduce_graph("world", 4), _context(topology))
    all_to_alls = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert [n.args[-1] for n in all_to_alls] == ["world"]  # quantized once, not twice


def test_a_world_of_one_gets_its_gradient_back_exactly(group_of_one):
    topology = Topology(1, 0, 1, group_of_one, node_group_name=group_of_one)
    gm = qgz(_reduce_graph(group_of_one, 1), _context(topology))
    assert c10d.all_to_all_single.default not in targets(gm)
    grad = torch.randn(40, 25)
    assert torch.equal(gm(grad), grad.reshape(-1))


def test_graph_is_unchanged_when_quantize_gradients_is_off(group_of_one):
    gm = _reduce_graph(group_of_one, 1)
    code = gm.code
    ctx = context(group_of_one, phase="backward")
    assert qgz(gm, ctx).code == code


def _three_reductions_graph(world: int):
    """Gradients of 4000, 1000 and 2000 fp32 values (16000, 4000, 8000 bytes), reduced in this order."""

    def backward(a, b, c):
        return [
            torch.ops.zpp.reduce_grad(g, g.numel(), g.numel() // world, world, "world") for g in (a * 2, b * 2, c * 2)
        ]

    return trace(backward, torch.randn(4000), torch.randn(1000), torch.randn(2000))


@pytest.mark.parametrize("cap,expected", [(0, [1, 1, 1]), (20000, [2, 1]), (28000, [3]), (25 * 2**20, [3])])
def test_consecutive_gradients_share_all_to_alls_up_to_the_bucket_size(cap, expected):
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
    gm = qgz(_three_reductions_graph(4), _context(topology, reduce_bucket_bytes=cap))
    in_node = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default and n.args[-1] == "node_0"]
    chunks = {4000: 1024, 1000: 256, 2000: 512}  # shard numel rounded up to blocks of 64
    sizes, start = [], 0
    for count in expected:
        sizes.append(sum(list(chunks.values())[start : start + count]))
        start += count
    assert [n.args[0].meta["val"].numel() for n in in_node] == [4 * chunk_payload_numel(s, 64) for s in sizes]
    outputs = gm.graph.output_node().args[0]
    assert [o.meta["val"].shape for o in outputs] == [(1000,), (250,), (500,)]


def test_bucketed_plan_keeps_every_gradient_in_a_world_of_one(group_of_one):
    topology = Topology(1, 0, 1, group_of_one, node_group_name=group_of_one)

    def backward(a, b):
        return [torch.ops.zpp.reduce_grad(g, g.numel(), g.numel(), 1, group_of_one) for g in (a, b)]

    gm = qgz(trace(backward, torch.randn(33), torch.randn(5, 7)), _context(topology))
    a, b = torch.randn(33), torch.randn(5, 7)
    got = gm(a, b)
    assert torch.equal(got[0], a) and torch.equal(got[1], b.reshape(-1))


# Runs in a fresh process: see call_targets_with_triton_kernels.
_TRACE_WITH_TRITON_KERNELS = """
import torch
from tests.passes.test_qgz import _context, _reduce_graph
from zpp_compile.passes import qgz
from zpp_compile.topology import Topology

topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
gm = qgz(_reduce_graph("world", 4), _context(topology))
print([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"])
"""


def test_triton_int4_kernels_enter_the_graph_as_user_kernels():
    targets = call_targets_with_triton_kernels(_TRACE_WITH_TRITON_KERNELS)
    # quantize_swizzled, the fused dequantize-reduce-requantize, and the final dequantize_reduce
    assert targets.count("triton_kernel_wrapper_functional") == 3, targets
    assert targets.count("all_to_all_single.default") == 2


def test_a_16_bit_gradient_crosses_nodes_as_a_quarter_of_its_bytes_plus_scales():
    """The int4 payload does not depend on the gradient's dtype: 1/4 of bf16 bytes, 1/8 of fp32."""
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")

    def backward(grad):
        return torch.ops.zpp.reduce_grad(grad, 1024, 256, 4, "world")

    gm = qgz(trace(backward, torch.randn(1024, dtype=torch.bfloat16)), _context(topology))
    cross = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default and n.args[-1] == "local_1"]
    (payload,) = [n.args[0].meta["val"] for n in cross]
    sent_to_the_other_node = payload.numel() // 2  # [2 nodes, P]: one row stays, one crosses
    shard_bf16_bytes = 256 * 2
    assert sent_to_the_other_node == chunk_payload_numel(256, 64) == shard_bf16_bytes // 4 + 4 * (256 // 64)
    (result,) = gm.graph.output_node().args
    assert result.meta["val"].dtype == torch.bfloat16
