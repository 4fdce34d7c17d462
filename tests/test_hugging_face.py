"""shard() on a Hugging Face model settles transformers' loss fallback (zpp_compile/hugging_face.py):
HF GPT-2 compiles without the graph break its loss logging made, and trains the same loss."""

from __future__ import annotations

import copy

import torch
from torch import nn

import zpp_compile
from zpp_compile.hugging_face import FALLBACK_LOSS_TYPE, name_fallback_loss_types

from .models import hf_gpt2, hf_llama


def test_only_the_outermost_models_that_fall_back_are_named():
    gpt2, llama, custom = hf_gpt2(), hf_llama(), hf_gpt2()
    custom.loss_type = "MyLoss"  # the user's own choice, unknown to transformers: theirs to see warned
    wrapped = nn.Sequential(nn.Linear(2, 2), gpt2)
    assert name_fallback_loss_types(wrapped) == ["1"]
    assert (gpt2.loss_type, gpt2.transformer.loss_type) == (FALLBACK_LOSS_TYPE, None)
    assert name_fallback_loss_types(llama) == [] and llama.loss_type == "ForCausalLM"  # named by its class
    assert name_fallback_loss_types(custom) == [] and custom.loss_type == "MyLoss"
    assert name_fallback_loss_types(nn.Linear(2, 2)) == []


def compiled_gpt2_breaks_and_losses() -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    reference = hf_gpt2()
    model = zpp_compile.shard(copy.deepcopy(reference))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    counters.clear()
    loss = torch.compile(model, backend="zeropp")(input_ids=tokens, labels=tokens).loss
    expected = reference(input_ids=tokens, labels=tokens).loss  # loss_type None: transformers' fallback
    return {
        "graph_breaks": dict(counters["graph_break"]),
        "loss_types": (reference.loss_type, model.loss_type),
        "gap": abs(loss.item() - expected.item()),
    }


def test_compiled_hugging_face_gpt2_has_no_graph_break_and_the_fallback_loss(pools):
    # Before: "logging.Logger method not supported" broke the graph in loss_function, and Dynamo
    # traced the model four times (three frames given up, then the one it compiled).
    for result in pools(2).run(compiled_gpt2_breaks_and_losses):
        assert result["graph_breaks"] == {}, result["graph_breaks"]
        assert result["loss_types"] == (None, FALLBACK_LOSS_TYPE)
        assert result["gap"] <= 1e-5, result["gap"]
