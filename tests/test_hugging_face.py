"""shard() on a Hugging Face model settles transformers' loss fallback (zpp_compile/hugging_face.py):
HF GPT-2 compiles without the graph break its loss logging made, and trains the same loss, also
under transformers' Trainer."""

from __future__ import annotations

import copy

import torch
from torch import nn

import zpp_compile
from zpp_compile.hugging_face import FALLBACK_LOSS_TYPE, FallbackLoss, pin_fallback_losses

from .models import hf_gpt2, hf_llama


def test_only_the_outermost_models_that_fall_back_get_the_fallback_loss():
    gpt2, llama, custom, own = hf_gpt2(), hf_llama(), hf_gpt2(), hf_gpt2()
    custom.loss_type = "MyLoss"  # the user's own choice, unknown to transformers: theirs to see warned
    own.loss_function = torch.nn.functional.cross_entropy  # the user's own loss function
    wrapped = nn.Sequential(nn.Linear(2, 2), gpt2)
    assert pin_fallback_losses(wrapped) == ["1"]
    assert isinstance(gpt2.loss_function, FallbackLoss) and "_loss_function" not in gpt2.transformer.__dict__
    assert gpt2.loss_type is None  # what transformers' Trainer reads (next test)
    assert pin_fallback_losses(llama) == [] and llama.loss_type == "ForCausalLM"  # named by its class
    assert pin_fallback_losses(custom) == [] and custom.loss_type == "MyLoss"
    assert pin_fallback_losses(own) == [] and own.loss_function is torch.nn.functional.cross_entropy
    assert pin_fallback_losses(nn.Linear(2, 2)) == []
    gpt2.loss_type = "ForMaskedLM"  # set later: the pinned loss follows it, as the property would
    assert gpt2.loss_function.mapping[gpt2.loss_type] is not gpt2.loss_function.mapping[FALLBACK_LOSS_TYPE]
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = gpt2(input_ids=tokens).logits
    expected = gpt2.loss_function.mapping["ForMaskedLM"](logits, tokens, vocab_size=64)
    assert torch.equal(gpt2.loss_function(logits, tokens, vocab_size=64), expected)


def test_trainer_counts_label_tokens_as_for_the_unsharded_model(tmp_path):
    # Trainer shifts its token count for a ForCausalLM loss_type, which scales the loss: naming the
    # loss type (rather than pinning the function) changed GPT-2's loss under Trainer.
    import transformers

    pinned, plain = hf_gpt2(), hf_gpt2()
    pin_fallback_losses(pinned)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    shifts = [transformers.Trainer(model=m, args=args)._loss_shifts_labels for m in (pinned, plain)]
    assert shifts[0] == shifts[1], shifts


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
        "loss_functions": (type(reference.loss_function).__name__, type(model.loss_function).__name__),
        "gap": abs(loss.item() - expected.item()),
    }


def test_compiled_hugging_face_gpt2_has_no_graph_break_and_the_fallback_loss(pools):
    # Before: "logging.Logger method not supported" broke the graph in loss_function, and Dynamo
    # traced the model four times (three frames given up, then the one it compiled).
    for result in pools(2).run(compiled_gpt2_breaks_and_losses):
        assert result["graph_breaks"] == {}, result["graph_breaks"]
        assert result["loss_functions"] == ("function", "FallbackLoss")
        assert result["gap"] <= 1e-5, result["gap"]
