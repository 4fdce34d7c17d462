"""Hugging Face architectures beyond GPT-2 and Llama, built from tiny configs (nothing downloaded):
sharded, they train like their unsharded copies. Each brings something the others do not: biases
on the attention projections (Qwen2), parallel residual and partial rotary (GPT-NeoX), an
encoder-decoder with one embedding shared three ways and relative attention bias (T5), token type
embeddings and a tied decoder with its own bias (BERT), routed experts (Mixtral), one layer's
parameters used at every depth and a factorized embedding (ALBERT)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zpp_compile

from .models import gradient_errors
from .test_training import RTOL

VOCAB, SEQ = 64, 16


def _tiny(name: str) -> nn.Module:
    import transformers as hf

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    builders = {
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(num_key_value_heads=1, **small)),
        "gpt_neox": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(rotary_pct=0.5, **small)),
        "t5": lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_ff=64,
                d_kv=16,
                num_layers=2,
                num_heads=2,
                dropout_rate=0.0,
                decoder_start_token_id=0,
            )  # fmt: skip
        ),
        "bert_mlm": lambda: hf.BertForMaskedLM(
            hf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small)
        ),
        "albert": lambda: hf.AlbertForMaskedLM(
            hf.AlbertConfig(embedding_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small)
        ),
        "mixtral": lambda: hf.MixtralForCausalLM(
            hf.MixtralConfig(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **small)
        ),
    }
    return builders[name]()


def two_steps(name: str, compiled: bool) -> dict:
    """Two SGD steps of the sharded model and of its unsharded copy, each rank on its own tokens:
    the loss difference and the gradient errors of both steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _tiny(name)
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, zpp_compile.Config())
    run = torch.compile(model, backend="zeropp") if compiled else model
    tokens = torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    errors, loss_gaps = {}, []
    for step in range(2):
        loss, expected = (m(input_ids=tokens, labels=tokens).loss for m in (run, reference))
        loss.backward()
        expected.backward()
        for p in reference.parameters():  # the reference's gradient, averaged as the reduce-scatter does
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        errors.update(gradient_errors(model, reference, step))
        loss_gaps.append(abs(loss.item() - expected.item()))
        with torch.no_grad():
            for m in (model, reference):
                for p in m.parameters():
                    p.add_(p.grad, alpha=-0.1)
                m.zero_grad(set_to_none=True)
    return {"errors": errors, "loss_gaps": loss_gaps}


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= RTOL, f"rank {rank}: {worst} differs by {r['errors'][worst]:.2e}"
        assert max(r["loss_gaps"]) <= 1e-5, (rank, r["loss_gaps"])


@pytest.mark.parametrize("name", ["qwen2", "gpt_neox", "t5", "bert_mlm", "mixtral", "albert"])
def test_eager_sharded_training_matches_the_unsharded_model(pools, name):
    _check(pools(2).run(two_steps, name, False))


@pytest.mark.parametrize("name", ["t5", "mixtral", "albert"])
def test_compiled_sharded_training_matches_the_unsharded_model(pools, name):
    _check(pools(2).run(two_steps, name, True))
