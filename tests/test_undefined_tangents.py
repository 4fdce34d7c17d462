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
    hidden states, then the loss alone; each step's gradients against the unsharded model's."""
    clear_compiled_graphs()
    torch.manual_seed(0)
    reference = hf_gpt2()
    model = zpp_compile.shard(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="zeropp", dynamic=dynamic)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    errors: dict[str, float] = {}
    for step, loss_of in enumerate((_loss_only, _loss_and_hidden_states, _loss_only)):
        loss_of(compiled(input_ids=tokens, labels=tokens, output_hidden_states=True)).backward()
        loss_of(reference(input_ids=tokens, labels=tokens, output_hidden_states=True)).backward()
        errors.update(gradient_errors(model, reference, step))
        model.zero_grad()
        reference.zero_grad()
    return {
        "variants": [r.backward_variants.variants() for r in compiled_graphs() if r.backward_variants],
        "largest_error": max(errors.values()),
    }


def test_outputs_without_a_gradient_reach_the_compiled_backward_as_none(pools):
    for result in pools(2).run(gpt2_backward_variants, False):
        # The graph with the most outputs is the model body. Each step's set of outputs that got
        # no gradient was compiled once, and the third step ran the first one's variant again.
        loss_only, with_hidden_states = max(result["variants"], key=lambda v: len(v[0]))
        assert len(loss_only) >= 3, result  # logits, hidden states, key/value caches: no zeros made
        assert set(with_hidden_states) < set(loss_only), result
        assert result["largest_error"] <= 1e-5, result


def test_dynamic_shapes_keep_autograds_zero_gradients(pools):
    # A tangent of symbolic size has nothing in the backward graph to size its zeros from.
    for result in pools(2).run(gpt2_backward_variants, True):
        assert all(v == [()] for v in result["variants"]), result
        assert result["largest_error"] <= 1e-5, result
