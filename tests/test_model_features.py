"""What real models do, compiled with the zeropp backend: dropout and other random ops, graph
breaks anywhere, recovery after an error, Hugging Face generate and gradient checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zpp_compile

from .models import batch, build, gradient_errors, loss_of, lowering_of
from .test_training import RTOL, _assert_close, train_vs_reference
from .workers import reset_process_state

SEED = 100


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def random_ops_against_replayed_draws(name: str, mode: str) -> dict:
    """Each rank seeds its own generator (SEED + rank), as data-parallel ranks do, and runs its
    micro-batch sharded (compiled or eager). The unsharded reference replays every rank's
    micro-batch from that rank's seed, so it draws the very same masks: the averaged gradients must
    match, and the generator must end where the eager forward leaves it (the backward reuses the
    forward's masks: a recomputed forward drawing new ones would move it further and change the
    gradients)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build(name)
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, zpp_compile.Config(lowering=lowering_of(mode)))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    x, y = batch(name, 2 * world, 0)
    torch.manual_seed(SEED + rank)
    loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    state_after_step = torch.get_rng_state()
    losses, reference_state = [], None
    for r in range(world):
        torch.manual_seed(SEED + r)
        losses.append(loss_of(name, reference, x.chunk(world)[r], y.chunk(world)[r]))
        reference_state = torch.get_rng_state() if r == rank else reference_state
    torch.stack(losses).mean().backward()
    same_rng = torch.equal(state_after_step, reference_state)
    # Ranks draw their own masks: the same input gives each rank another output.
    torch.manual_seed(SEED + rank)
    probe = loss_of(name, run, x[:2], y[:2]).detach()
    probes = [torch.empty_like(probe) for _ in range(world)]
    dist.all_gather(probes, probe)
    return {
        "errors": gradient_errors(model, reference, 0),
        "same_rng": same_rng,
        "ranks_differ": not torch.equal(*probes[:2]),
    }


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["random_mlp", "hf_gpt2_dropout"])
def test_random_ops_draw_what_eager_draws_and_backward_reuses_the_masks(pools, name, mode):
    results = pools(2).run(random_ops_against_replayed_draws, name, mode)
    _assert_close([r["errors"] for r in results])
    assert all(r["same_rng"] for r in results), "the generator moved differently from eager: masks re-drawn?"
    assert all(r["ranks_differ"] for r in results)


def seeded_losses(name: str) -> list[float]:
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name))
    compiled = torch.compile(model, backend="zeropp")
    losses = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        x, y = batch(name, 2, 0)
        losses.append(loss_of(name, compiled, x, y).item())
    return losses


def test_manual_seed_makes_dropout_repeatable(pools):
    for same, again, other in pools(2).run(seeded_losses, "hf_gpt2_dropout"):
        assert same == again and other != same


@pytest.mark.parametrize("mode", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["break_gpt", "break_read_mlp"])
def test_graph_breaks_anywhere_train_like_unsharded(pools, name, mode):
    # break_gpt: a break inside the loop over blocks (Dynamo runs that loop eagerly and compiles
    # each block's modules), one in the loss, and the tied embedding read across them;
    # break_read_mlp: weights (a frozen one too) read before a break and used after it.
    _assert_close(pools(2).run(train_vs_reference, name, mode, 3))


def graphs_of_a_break_in_a_loop() -> int:
    """The blocks' modules share compiled graphs: no recompile per module instance."""
    from torch._dynamo.utils import counters

    counters.clear()
    train_vs_reference("break_gpt", "aot_eager", 1)
    return counters["stats"]["unique_graphs"]


def test_a_break_in_a_loop_does_not_compile_per_module(pools):
    # The attention module's forward is compiled once for both blocks; per-module hooks or names
    # in the graphs used to make Dynamo compile each block (and every parameter read) apart.
    assert pools(2).run(graphs_of_a_break_in_a_loop)[0] <= 4


def error_then_new_model() -> str:
    torch.manual_seed(0)
    broken = zpp_compile.shard(build("mlp"))
    broken.fc1.weight = nn.Parameter(torch.zeros(29, 13))
    x, y = batch("mlp", 4, 0)
    try:
        loss_of("mlp", torch.compile(broken, backend="zeropp"), x[:2], y[:2])
    except zpp_compile.ShardingError:
        pass
    fresh = zpp_compile.shard(build("mlp"))
    loss_of("mlp", torch.compile(fresh, backend="zeropp"), x[:2], y[:2]).backward()
    return "trained" if all(p.grad is not None for p in fresh.parameters() if p.requires_grad) else "no grads"


def test_an_error_leaves_the_process_able_to_compile_the_next_model(pools):
    assert pools(2).run(error_then_new_model) == ["trained", "trained"]


def generate_like_unsharded() -> dict:
    torch.manual_seed(0)
    unsharded = build("hf_gpt2").eval()
    model = zpp_compile.shard(copy.deepcopy(unsharded)).eval()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded prompt: the attention mask matters
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = unsharded.generate(prompt, **kwargs)
        eager = model.generate(prompt, **kwargs)
        compiled = torch.compile(model, backend="zeropp").generate(prompt, **kwargs)
    return {"eager": torch.equal(eager, expected), "compiled": torch.equal(compiled, expected)}


def test_generate_for_evaluation_matches_the_unsharded_model(pools):
    for result in pools(2).run(generate_like_unsharded):
        assert all(result.values()), result


def generate_ending_apart(wrapping: str) -> dict:
    """Each rank generates from its own prompt; rank 0's reaches EOS by its second new token, rank
    1's later. Rank 0 keeps stepping (transformers' synced_gpus, the default shard() sets) instead
    of leaving rank 1 waiting in a gather; both get the unsharded model's tokens."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    unsharded = build("hf_gpt2").eval()
    model = copy.deepcopy(unsharded)
    if wrapping == "peft":
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        unsharded = get_peft_model(unsharded, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
        model = copy.deepcopy(unsharded)
    model = zpp_compile.shard(model, zpp_compile.Config(collective_timeout_s=60)).eval()
    run = torch.compile(model, backend="zeropp") if wrapping == "compiled" else model
    prompts = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eos = int(unsharded.generate(prompts[:1], **kwargs)[0, 6])  # rank 0's second new token
        expected = unsharded.generate(prompts[rank : rank + 1], eos_token_id=eos, **kwargs)
        explicit = {"synced_gpus": False} if wrapping == "synced_gpus=False" else {}  # as Seq2SeqTrainer passes
        got = run.generate(prompts[rank : rank + 1], eos_token_id=eos, **kwargs, **explicit)
    return {"new_tokens": expected.shape[1] - 5, "same": torch.equal(got, expected)}


@pytest.mark.parametrize("wrapping", ["eager", "compiled", "peft", "synced_gpus=False"])
def test_generate_ending_at_a_different_step_on_each_rank_gives_each_its_tokens(pools, wrapping):
    results = pools(2).run(generate_ending_apart, wrapping)
    assert results[0]["new_tokens"] < results[1]["new_tokens"], results  # the ranks end apart
    assert all(r["same"] for r in results), results


def checkpointing_vs_not(mode: str) -> dict[str, float]:
    """Hugging Face's gradient_checkpointing_enable() (torch.utils.checkpoint around each layer)
    gives the gradients of the run without it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, _ = batch("hf_llama", 2 * world, 0)
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build("hf_llama")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        zpp_compile.shard(model, zpp_compile.Config(lowering=lowering_of(mode))).train()
        run = model if mode == "eager" else torch.compile(model, backend="zeropp")
        loss_of("hf_llama", run, x.chunk(world)[rank], None).backward()
        grads[checkpointing] = _full_grads(model)
        reset_process_state()
    return {n: ((grads[True][n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in grads[False].items()}


@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_hugging_face_gradient_checkpointing_gives_the_same_gradients(pools, mode):
    for errors in pools(2).run(checkpointing_vs_not, mode):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL * 10, f"{worst}: {errors[worst]:.2e}"


def _batchnorm_against_ddp(steps: int) -> dict:
    """BatchNormNet sharded and compiled, and DDP on a copy, trained alike on this rank's batches:
    the losses, and each one's buffers before and after zpp_compile.broadcast_buffers()."""
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        torch.manual_seed(SEED)
        model = build("batchnorm")
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        with pytest.warns(UserWarning, match=r"2 normalization layers \(norm1, ...\).*broadcast_buffers"):
            zpp_compile.shard(model, zpp_compile.Config())
        compiled = torch.compile(model, backend="zeropp")
        losses = {"zeropp": [], "ddp": []}
        for run, name in ((compiled, "zeropp"), (ddp, "ddp")):
            opt = torch.optim.SGD(run.parameters(), lr=0.1)
            for step in range(steps):
                x, y = batch("batchnorm", 2 * world, step)
                loss = loss_of("batchnorm", run, x.chunk(world)[rank], y.chunk(world)[rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
        before = {n: b.clone() for n, b in model.named_buffers()}
        zpp_compile.broadcast_buffers(model)
        after = dict(model.named_buffers())
        return {
            "losses": losses, "before": before, "after": after, "ddp": dict(ddp.module.named_buffers()),
            "payloads": _frozen_payloads_around_broadcast_buffers(),
        }  # fmt: skip
    finally:
        reset_process_state()


def _frozen_payloads_around_broadcast_buffers() -> tuple[dict, dict]:
    """The uneven MLP's frozen layer quantized at shard() (its int8 shard is a buffer of each
    rank's own): its buffers before and after broadcast_buffers()."""
    model = zpp_compile.shard(build("mlp"), zpp_compile.Config(quantize_frozen_weights=True))
    before = {n: b.clone() for n, b in model.named_buffers()}
    zpp_compile.broadcast_buffers(model)
    return before, dict(model.named_buffers())


def test_running_statistics_differ_per_rank_until_broadcast_buffers_gives_every_rank_rank0s(pools):
    """BatchNorm under zeropp trains as under DDP (same losses), and rank 0's running statistics are
    DDP's; each other rank keeps its own (DDP broadcasts rank 0's before every forward) until
    broadcast_buffers(), after which every rank holds rank 0's, bitwise."""
    results = pools(2).run(_batchnorm_against_ddp, 2)
    for result in results:
        torch.testing.assert_close(result["losses"]["zeropp"], result["losses"]["ddp"], rtol=1e-5, atol=1e-6)
    rank0, rank1 = results
    assert not torch.equal(rank0["before"]["norm1.running_mean"], rank1["before"]["norm1.running_mean"])
    for name, buffer in rank0["before"].items():
        torch.testing.assert_close(buffer, rank0["ddp"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(rank1["after"][name], buffer), name
        assert torch.equal(rank0["after"][name], buffer), name
    # A frozen weight's int8 shard is each rank's own: broadcast_buffers() leaves it.
    payloads = [name for name in rank0["payloads"][0] if name.startswith("frozen.")]
    assert payloads and any(not torch.equal(rank0["payloads"][0][n], rank1["payloads"][0][n]) for n in payloads)
    for before, after in (rank0["payloads"], rank1["payloads"]):
        assert all(torch.equal(after[name], before[name]) for name in before), payloads
