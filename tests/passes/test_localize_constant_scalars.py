import torch

from zpp_compile.passes import localize_constant_scalars

from .helpers import context, trace

aten = torch.ops.aten


def _two_layers(x, w, pi):
    # HF GPT-2's GELU constant as Dynamo traces it under dynamic shapes: computed once from an
    # unspecialized float input, read by every layer.
    scale = torch.sqrt(torch.full([], 2.0, dtype=torch.float64) / pi).float()
    x = torch.tanh(x * scale) @ w
    return torch.tanh(x * scale) @ w


def _inputs():
    return torch.randn(4, 8), torch.randn(8, 8), torch.tensor(torch.pi, dtype=torch.float64)


def _count(gm, target) -> int:
    return sum(n.target == target for n in gm.graph.nodes)


def test_each_reader_of_a_shared_constant_scalar_computes_its_own(group_of_one):
    gm = trace(_two_layers, *_inputs())
    assert _count(gm, aten.sqrt.default) == 1
    inputs = _inputs()
    before = gm(*inputs)
    gm = localize_constant_scalars(gm, context(group_of_one, phase="joint"))
    # One chain per layer, placed right before the multiply that reads it; the input is not copied.
    assert _count(gm, aten.sqrt.default) == 2
    for mul in (n for n in gm.graph.nodes if n.target == aten.mul.Tensor):
        scale = mul.args[1]
        assert len(scale.users) == 1 and scale.next is mul
    assert sum(n.op == "placeholder" for n in gm.graph.nodes) == 3
    assert torch.equal(gm(*inputs), before)  # the same ops: bitwise the same values


def test_a_constant_read_once_or_drawn_at_random_is_left_alone(group_of_one):
    def read_once_and_random(x):
        once = torch.sqrt(torch.full([], 2.0))
        drawn = torch.rand([])  # one draw, shared: copying it would draw twice
        return torch.tanh(x * once) * drawn + x * drawn

    gm = trace(read_once_and_random, torch.randn(4))
    targets = [n.target for n in gm.graph.nodes]
    gm = localize_constant_scalars(gm, context(group_of_one, phase="joint"))
    assert [n.target for n in gm.graph.nodes] == targets
