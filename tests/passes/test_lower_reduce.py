import torch

import zpp_compile  # noqa: F401
from zpp_compile.passes import lower_reduce

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional


def test_reduce_marker_becomes_padded_reduce_scatter_and_one_average(group_of_one):
    grad = torch.randn(3, 5).t()  # strided: the pass must make it contiguous first
    gm = trace(lambda g: torch.ops.zpp.reduce_grad(g, 15, 15, 1, group_of_one), grad)
    expected = gm(grad)

    gm = lower_reduce(gm, context(group_of_one))
    after = targets(gm)
    assert torch.ops.zpp.reduce_grad.default not in after
    assert after.count(c10d.reduce_scatter_tensor.default) == 1
    assert after.count(torch.ops.aten.div.Tensor) == 1
    assert torch.ops.aten.clone.default in after
    rs = next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default)
    assert rs.args[1] == "sum"
    torch.testing.assert_close(gm(grad), expected)
    torch.testing.assert_close(expected, grad.reshape(-1))


def test_graph_without_markers_is_returned_unchanged(group_of_one):
    gm = trace(lambda x: x.cos(), torch.randn(3))
    code = gm.code
    assert lower_reduce(gm, context(group_of_one)).code == code
