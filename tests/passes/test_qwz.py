import torch

import zpp_compile  # noqa: F401
from zpp_compile.codegen.quantize import dequantize_int8_blocks, quantize_int8_blocks
from zpp_compile.passes import qwz

from .helpers import call_targets_with_triton_kernels, context, targets, trace

c10d = torch.ops._c10d_functional


def _gather_graph(group_name):
    shard, x = torch.randn(200), torch.randn(3, 20)  # 200 = 4 blocks of 64 minus padding

    def f(shard, x):
        return x @ torch.ops.zpp.gather_param(shard, 200, [10, 20], 200, 1, group_name).t()

    return trace(f, shard, x), shard, x


def test_forward_gather_becomes_one_int8_gather_of_the_packed_payload(group_of_one):
    gm, shard, x = _gather_graph(group_of_one)
    gm = qwz(gm, context(group_of_one, quantize_weights=True, weight_block_size=64))
    assert torch.ops.zpp.gather_param.default not in targets(gm)
    gathers = [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    assert [g.args[0].meta["val"].dtype for g in gathers] == [torch.int8]
    assert [g.args[0].meta["val"].numel() for g in gathers] == [4 * 64 + 4 * 4]  # 4 blocks + 4 fp32 scales
    q, scale = quantize_int8_blocks(shard, 64)
    expected_weight = dequantize_int8_blocks(q, scale, torch.float32)[:200].view(10, 20)
    torch.testing.assert_close(gm(shard, x), x @ expected_weight.t())
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, f"{node.name} lost its fake value"


# Runs in a fresh process: see call_targets_with_triton_kernels.
_TRACE_WITH_TRITON_KERNELS = """
import torch
from tests.passes.helpers import context, trace
from zpp_compile.passes import qwz

def f(shard, x):
    return x @ torch.ops.zpp.gather_param(shard, 200, [10, 20], 60, 4, "some_group").t()

gm = qwz(trace(f, torch.randn(3, 20), torch.randn(3, 20)), context("some_group", quantize_weights=True))
print([n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"])
"""


def test_triton_kernels_enter_the_graph_as_user_kernels():
    targets = call_targets_with_triton_kernels(_TRACE_WITH_TRITON_KERNELS)
    kernels = [t for t in targets if t == "triton_kernel_wrapper_functional"]
    assert len(kernels) == 2, f"quantize and dequantize must reach Inductor as Triton kernels: {targets}"
    assert targets.count("all_gather_into_tensor.default") == 1
    assert "gather_param.default" not in targets


def test_graph_is_unchanged_when_quantize_weights_is_off(group_of_one):
    gm, _, _ = _gather_graph(group_of_one)
    code = gm.code
    assert qwz(gm, context(group_of_one)).code == code


def test_mixed_precision_quantizes_the_master_shard_and_dequantizes_to_param_dtype(group_of_one):
    shard, x = torch.randn(200), torch.randn(3, 20, dtype=torch.bfloat16)

    def f(shard, x):
        return x @ torch.ops.zpp.gather_param(shard, 200, [10, 20], 200, 1, group_of_one, dtype=torch.bfloat16).t()

    gm = qwz(trace(f, shard, x), context(group_of_one, quantize_weights=True, weight_block_size=64))
    (gather,) = [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    assert gather.args[0].meta["val"].dtype == torch.int8
    casts = [n for n in gm.graph.nodes if n.target == torch.ops.prims.convert_element_type.default]
    assert all(c.args[0].op != "placeholder" for c in casts), "the fp32 master is quantized, not a bf16 copy of it"
    q, scale = quantize_int8_blocks(shard, 64)  # from the fp32 master: no bf16 rounding before int8
    expected_weight = dequantize_int8_blocks(q, scale, torch.bfloat16)[:200].view(10, 20)
    assert gm(shard, x).dtype == torch.bfloat16
    torch.testing.assert_close(gm(shard, x), x @ expected_weight.t())
