import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.passes import lower_gather

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional


def test_gather_marker_becomes_pad_all_gather_wait_slice_view(group_of_one):
    local, x = torch.randn(2, 3), torch.randn(4, 3)  # a rank's chunk sent padded: 8 elements for 6

    def f_padded(local, x):
        w = torch.ops.zpp.gather_param(local, 6, [2, 3], 8, 1, group_of_one)
        return x @ w.t()

    gm = trace(f_padded, local, x)
    assert torch.ops.zpp.gather_param.default in targets(gm)
    expected = gm(local, x)

    gm = lower_gather(gm, context(group_of_one))
    after = targets(gm)
    assert torch.ops.zpp.gather_param.default not in after
    assert after.count(c10d.all_gather_into_tensor.default) == 1
    assert after.count(c10d.wait_tensor.default) == 1
    assert torch.ops.aten.constant_pad_nd.default in after  # 6 -> 8 elements on the wire
    assert torch.ops.aten.slice.Tensor in after  # padding (8 -> 6 elements) is cut off
    torch.testing.assert_close(gm(local, x), expected)
    torch.testing.assert_close(expected, x @ local.t())
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, f"{node.name} lost its fake value"


def test_unpadded_gather_needs_no_slice(group_of_one):
    gm = trace(lambda s: torch.ops.zpp.gather_param(s, 6, [3, 2], 6, 1, group_of_one) * 2, torch.randn(6))
    gm = lower_gather(gm, context(group_of_one))
    assert torch.ops.aten.slice.Tensor not in targets(gm)


def test_graph_without_markers_is_returned_unchanged(group_of_one):
    gm = trace(lambda x: x.sin(), torch.randn(3))
    code = gm.code
    assert lower_gather(gm, context(group_of_one)).code == code


def test_mixed_precision_casts_the_shard_before_the_wire(group_of_one):
    def f(s):
        return torch.ops.zpp.gather_param(s, 6, [3, 2], 6, 1, group_of_one, dtype=torch.bfloat16)

    shard = torch.randn(6)
    gm = lower_gather(trace(f, shard), context(group_of_one))
    (gather,) = [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    assert gather.args[0].target == torch.ops.prims.convert_element_type.default
    assert gather.args[0].meta["val"].dtype == torch.bfloat16, "the all-gather must carry bf16, not fp32"
    assert torch.equal(gm(shard), shard.to(torch.bfloat16).view(3, 2))


def test_a_pipeline_regenerates_the_code_once_and_it_runs_the_rewritten_graph(group_of_one, monkeypatch):
    from zpp_compile.passes import FORWARD_PASSES, run_passes

    from .helpers import gathering_layers

    gm, args = gathering_layers(group_of_one)
    expected = gm(*args)
    recompiles = []
    real = type(gm).recompile
    monkeypatch.setattr(type(gm), "recompile", lambda self: recompiles.append(self) or real(self))
    gm = run_passes(gm, context(group_of_one), FORWARD_PASSES)
    assert len(recompiles) == 1  # not once per pass that rewrote the graph
    assert gm.code == gm.graph.python_code("self").src
    torch.testing.assert_close(gm(*args), expected)
