"""A compiled backward gets None, not autograd's zero-filled tensors, for the outputs no gradient
reaches, and runs a variant compiled with those tangents as zeros inside the graph
(zpp_compile/undefined_tangents.py): here the logits, hidden states and key/value caches a
Hugging Face model returns beside the loss."""

from __future__ import annotations

import copy

import pytest
import torch

import zpp_compile
from zpp_compile.backend import clear_compiled_graphs, compiled_graphs

from .models import gradient_errors, hf_gpt2


def _loss_only(out) -> torch.Tensor:
    return out.loss


def _loss_and_hidden_states(out) -> torch.Tensor:
    return out.loss + sum((h * h).mean() for h in out.hidden_states)


def gpt2_backward_variants(dynamic: bool, first: tuple[int, int] = (2, 16)) -> dict:
    """Three steps of HF GPT-2 (every rank the same tokens): the loss alone, then the loss and the
    hidden states (both on a `first`-shaped batch), then the loss alone (on a batch of another
    shape where `dynamic`); each step's gradients against the unsharded model's."""
    clear_compiled_graphs()
    torch.manual_seed(0)
    reference = hf_gpt2()
    model = zpp_compile.shard(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="zeropp", dynamic=dynamic)
    generator = torch.Generator().manual_seed(1)
    shapes = [first, first, (3, 11) if dynamic else first]
    errors: dict[str, float] = {}
    for step, loss_of in enumerate((_loss_only, _loss_and_hidden_states, _loss_only)):
        tokens = torch.randint(0, 64, shapes[step], generator=generator)
        loss_of(compiled(input_ids=tokens, labels=tokens, output_hidden_states=True)).backward()
        loss_of(reference(input_ids=tokens, labels=tokens, output_hidden_states=True)).backward()
        errors.update(gradient_errors(model, reference, step))
        model.zero_grad()
        reference.zero_grad()
    variants = [r.backward_variants for r in compiled_graphs() if r.backward_variants]
    return {
        "variants": [v.variants() for v in variants],
        "folded": [v.folded() for v in variants],
        "largest_error": max(errors.values()),
    }


def _check_variants(result: dict) -> None:
    # The model body's graph (the one with the most outputs of the first steps' graphs; a third
    # step of another shape may need a graph of its own): each step's set of outputs that got no
    # gradient was compiled once, and the third step ran the first one's variant again. In every
    # graph every undefined tangent became zeros inside the graph (none made at run time).
    two_steps = [v for v in result["variants"] if len(v) == 2]
    loss_only, with_hidden_states = max(two_steps, key=lambda v: len(v[0]))
    assert len(loss_only) >= 3, result  # logits, hidden states, key/value caches: no zeros made
    assert set(with_hidden_states) < set(loss_only), result
    assert result["folded"] == result["variants"], result
    assert result["largest_error"] <= 1e-5, result


def test_outputs_without_a_gradient_reach_the_compiled_backward_as_none(pools):
    for result in pools(2).run(gpt2_backward_variants, False):
        _check_variants(result)


# A square batch: Dynamo's duck sizing gives batch and sequence one symbol s0, and the logits'
# tangent is sized (s0, (s0**2)//s0, vocab) -- a floor division to rebuild (it was filled at run
# time before: 196 MB per rank-step at 32 x 32 tokens of a 50257-token vocabulary).
@pytest.mark.parametrize("first", [(2, 16), (16, 16)], ids=["batch_x_sequence", "square"])
def test_dynamic_shapes_make_the_zeros_from_the_backwards_symbols(pools, first):
    # The tangents' sizes are symbolic (batch, sequence): the zeros are sized from the symbols
    # AOTAutograd hands the backward.
    for result in pools(2).run(gpt2_backward_variants, True, first):
        _check_variants(result)


def _backward_of_symbolic_tangents() -> torch.fx.GraphModule:
    """A backward graph by hand: symbol inputs s0, s1 and two tangents of symbolic size, the first
    transposed (not contiguous), returning tangents_1.t() + tangents_2."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    value = mode.from_tensor(torch.randn(5, 3), symbolic_context=dynamic)
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(name) for name in ("primals_1", "primals_2", "tangents_1", "tangents_2")]
    for node, val in zip(inputs, (*value.shape, value.t(), value)):
        node.meta["val"] = val
    transposed = graph.call_method("t", (inputs[2],))
    graph.output((graph.call_function(torch.add, (transposed, inputs[3])),))
    return torch.fx.GraphModule({}, graph)


def test_symbolic_tangents_are_sized_from_the_calls_symbols():
    from functorch.compile import make_boxed_func

    from zpp_compile.undefined_tangents import TangentVariants

    variants = TangentVariants(_backward_of_symbolic_tangents(), [], lambda gm, _: make_boxed_func(gm.forward))
    for rows, cols in ((5, 3), (2, 7)):
        (grad,) = variants([rows, cols, None, None])
        assert grad.shape == (rows, cols) and not grad.any()
    defined = torch.ones(2, 4)
    (grad,) = variants([4, 2, defined, None])
    assert torch.equal(grad, defined.t())
    # The contiguous tangent became zeros inside the graph, the transposed one is filled at run time.
    assert variants.variants() == [(2, 3), (3,)]
    assert variants.folded() == [(3,), (3,)]
