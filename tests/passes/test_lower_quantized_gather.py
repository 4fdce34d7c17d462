import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.codegen.quantize import payload_numel, quantize_packed
from zpp_compile.passes import dedupe_gathers, lower_quantized_gather

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional
BLOCK = 64


def _frozen_weight_graph(group_name: str, payload: torch.Tensor, dtype: torch.dtype):
    def f(payload, x):  # the weight read twice, as a tied frozen embedding would be
        w = torch.ops.zpp.gather_quantized_param(payload, 200, [10, 20], 200, BLOCK, dtype, 1, group_name)
        w2 = torch.ops.zpp.gather_quantized_param(payload, 200, [10, 20], 200, BLOCK, dtype, 1, group_name)
        return x @ w.t() + x @ w2.t()

    return trace(f, payload, torch.randn(3, 20).to(dtype))


def test_frozen_gather_becomes_one_int8_all_gather_and_a_dequantize(group_of_one):
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(200).to(dtype)
        payload, x = quantize_packed(weight, BLOCK), torch.randn(3, 20).to(dtype)
        gm = _frozen_weight_graph(group_of_one, payload, dtype)
        expected = gm(payload, x)  # the markers' eager implementation: gather + reference dequantize
        gm = dedupe_gathers(gm, context(group_of_one))
        assert targets(gm).count(torch.ops.zpp.gather_quantized_param.default) == 1
        gm = lower_quantized_gather(gm, context(group_of_one))
        gathers = [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
        assert [(g.args[0].meta["val"].dtype, g.args[0].meta["val"].numel()) for g in gathers] == [
            (torch.int8, payload_numel(200, BLOCK))
        ]
        assert torch.ops.zpp.gather_quantized_param.default not in targets(gm)
        assert torch.ops.aten.amax.default not in targets(gm), "a frozen payload needs no quantize step"
        assert torch.equal(gm(payload, x), expected)
