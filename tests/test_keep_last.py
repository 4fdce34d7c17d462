"""Config.keep_last_weights_gathered: the forward's last weights outside the repeated blocks stay
gathered into the backward, compiled (passes/recompute.py kept_for_backward) and eager
(regather.py), on models we did not write and on ours."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.layout import shard_spec

from .models import LayerFrames, batch, build, local_grad, loss_of

# The weights outside the blocks each model reads last and the backward reads: GPT-2's final norm
# and its head tied to the embedding, Llama's final norm and head, our GPT's final norm and head (tied too).
TAIL = {
    "hf_gpt2": {"transformer.ln_f.weight", "transformer.wte.weight"},
    "hf_llama": {"model.norm.weight", "lm_head.weight"},
    "gpt": {"ln_f.weight", "wte.weight"},
}
# Eager autograd also saves the final LayerNorm's bias (native_layer_norm keeps it for its
# backward), so the eager backward gathered that again too; the compiled backward never reads it.
EAGER_ALSO = {"hf_gpt2": {"transformer.ln_f.bias"}, "hf_llama": set(), "gpt": {"ln_f.bias"}}


def one_step(name: str, keep_last: bool, compiled: bool) -> dict:
    """One forward and backward: the backward's all-gather bytes, the tail's, and the gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name), zpp_compile.Config(keep_last_weights_gathered=keep_last))
    x, y = batch(name, 2 * world, 0)
    counter = zpp_compile.comm_counter()
    counter.reset()
    run = torch.compile(model, backend="zeropp") if compiled else model
    loss = loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank])
    loss.backward()
    params = dict(model.named_parameters())
    return {
        "loss": loss.item(),
        "backward_gather_bytes": counter.bytes(phase="backward", op="all_gather"),
        # What one all-gather of each tail weight sends from this rank: its shard to every peer.
        "tail_bytes": sum(
            shard_spec(params[n]).shard_numel * params[n].element_size() * (world - 1)
            for n in TAIL[name] | (set() if compiled else EAGER_ALSO[name])
        ),
        "grads": {n: local_grad(p) for n, p in params.items() if p.requires_grad},
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "gpt"])
def test_the_tail_is_not_gathered_again_and_the_gradients_stay(pools, name, compiled):
    regathered, kept = (pools(2).run(one_step, name, keep_last, compiled) for keep_last in (False, True))
    for rank in range(2):
        assert (
            kept[rank]["backward_gather_bytes"] == regathered[rank]["backward_gather_bytes"] - kept[rank]["tail_bytes"]
        )
        assert kept[rank]["loss"] == regathered[rank]["loss"]
        for param, grad in regathered[rank]["grads"].items():
            assert torch.equal(kept[rank]["grads"][param], grad), param


def layer_reused_step(keep_last: bool) -> dict:
    model = zpp_compile.shard(LayerFrames(), zpp_compile.Config(keep_last_weights_gathered=keep_last))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    counter = zpp_compile.comm_counter()
    counter.reset()
    torch.compile(model, backend="zeropp")(x).square().mean().backward()
    fc2 = model.proj.fc2.weight
    return {
        "backward_gather_bytes": counter.bytes(phase="backward", op="all_gather"),
        "proj_fc2_bytes": shard_spec(fc2).shard_numel * fc2.element_size() * (dist.get_world_size() - 1),
        "grads": {n: local_grad(p) for n, p in model.named_parameters()},
    }


def test_a_graph_kept_for_a_layer_outside_the_blocks_is_not_reused_inside_them(pools):
    regathered, kept = (pools(2).run(layer_reused_step, keep_last) for keep_last in (False, True))
    for rank in range(2):
        # Only proj's graph keeps a weight: the blocks' layers, compiled apart, keep none.
        saved = regathered[rank]["backward_gather_bytes"] - kept[rank]["backward_gather_bytes"]
        assert saved == kept[rank]["proj_fc2_bytes"]
        for param, grad in regathered[rank]["grads"].items():
            assert torch.equal(kept[rank]["grads"][param], grad), param
