"""A compiled backward gets None, not autograd's zero-filled tensors, for the outputs no gradient
reaches, and runs a variant compiled with those tangents as zeros inside the graph
(zpp_compile/undefined_tangents.py): here the logits, hidden states and key/value caches a
Hugging Face model returns beside the loss."""

from __future__ import annotations

import copy

import torch

import zpp_compile
from zpp_compile.backend import clear_compiled_graphs, compiled_graphs

from .models import gradient_errors, hf_gpt2


def _loss_only(out) -> torch.Tensor:
    return out.loss


def _loss_and_hidden_states(out) -> torch.Tensor:
    return out.loss + sum((h * h).mean() for h in out.hidden_states)


def gpt2_backward_variants(dynamic: bool) -> dict:
    """Three steps of HF GPT-2 (every rank the same tokens): the loss alone, then the loss and the
    hidden states, then the loss alone (on a batch of another shape where `dynamic`); each step's
    gradients against the unsharded model's."""
    clear_compiled_graphs()
    torch.manual_seed(0)
    reference = hf_gpt2()
    model = zpp_compile.shard(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="zeropp", dynamic=dynamic)
    generator = torch.Generator().manual_seed(1)
    shapes = [(2, 16), (2, 16), (3, 11) if dynamic else (2, 16)]
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
    # The graph with the most outputs is the model body. Each step's set of outputs that got no
    # gradient was compiled once, and the third step ran the first one's variant again; every
    # undefined tangent became zeros inside the graph (none made at run time).
    body = max(range(len(result["variants"])), key=lambda i: len(result["variants"][i][0]))
    loss_only, with_hidden_states = result["variants"][body]
    assert len(loss_only) >= 3, result  # logits, hidden states, key/value caches: no zeros made
    assert set(with_hidden_states) < set(loss_only), result
    assert result["folded"][body] == result["variants"][body], result
    assert result["largest_error"] <= 1e-5, result


def test_outputs_without_a_gradient_reach_the_compiled_backward_as_none(pools):
    for result in pools(2).run(gpt2_backward_variants, False):
        _check_variants(result)


def test_dynamic_shapes_make_the_zeros_from_the_backwards_symbols(pools):
    # The tangents' sizes are symbolic (batch, sequence): the zeros are sized from the symbols
    # AOTAutograd hands the backward.
    for result in pools(2).run(gpt2_backward_variants, True):
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
