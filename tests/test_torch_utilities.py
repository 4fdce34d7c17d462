"""Sharded parameters behave like torch's: clipping, writes and nn.init, shapes, an EMA of the
weights, full state dicts, Hugging Face save_pretrained, and DistributedDataParallel refused. Each test compares against the
same call on an unsharded copy of the model."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

import zpp_compile
from examples.gpt import _init_weights

from .models import (
    HF_MODELS,
    batch,
    build,
    loss_of,
    lowering_of,
    sharded_with_reference,
    torchrun_environment,
    trainer_dataset,
)

MAX_NORM = 0.1
INF = float("inf")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type
    ).item()


# --------------------------------------------------------------------------------------------
# Gradient clipping


def clip_vs_unsharded(name: str, norm_type: float, mode: str, config: dict) -> dict:
    """One step sharded and unsharded on the same global batch; torch's clip_grad_norm_ on both."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, run, _, reference, _ = sharded_with_reference(
        name, mode, zpp_compile.Config(lowering=lowering_of(mode), **config)
    )
    x, y = batch(name, 2 * world, 0)
    loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    loss_of(name, reference, x, y).backward()
    own = _total_norm([_full(p.grad) for p in model.parameters() if p.grad is not None], norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type).item()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)  # the user's loop
    explicit = zpp_compile.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    after = _total_norm([_full(p.grad) for p in model.parameters() if p.grad is not None], norm_type)
    return {
        "torch": _full(total).item(),
        "explicit_plain": type(explicit) is torch.Tensor,
        "explicit": explicit.item(),
        "own": own,
        "unsharded": expected,
        "after": after,
        "reference_after": _total_norm([p.grad for p in reference.parameters() if p.grad is not None], norm_type),
    }


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("name, world", [("mlp", 2), ("gpt", 2), ("short_mlp", 4)])
def test_torch_clip_grad_norm_clips_by_the_global_norm(pools, name, world, norm_type):
    # OddMLP: a frozen layer (no grad: skipped), a 0-d replicated parameter, uneven shards; GPT: tied
    # embeddings (counted once); ShortMLP at world 4: a rank holding no rows (the inf-norm's corner).
    for rank, r in enumerate(pools(world).run(clip_vs_unsharded, name, norm_type, "eager", {})):
        assert r["torch"] == pytest.approx(r["unsharded"], rel=1e-5), f"rank {rank}: {r}"
        assert r["own"] == pytest.approx(r["unsharded"], rel=1e-5)
        # The second clip (explicit) sees the already clipped gradients: MAX_NORM, as torch would.
        assert r["explicit_plain"] and r["explicit"] == pytest.approx(MAX_NORM, rel=1e-4)
        assert r["after"] == pytest.approx(r["reference_after"], rel=1e-4) == pytest.approx(MAX_NORM, rel=1e-4)


@pytest.mark.parametrize("name", HF_MODELS)
def test_clipping_hugging_face_models(pools, name):
    for r in pools(2).run(clip_vs_unsharded, name, 2.0, "eager", {}):
        assert r["torch"] == pytest.approx(r["unsharded"], rel=1e-5)
        assert r["after"] == pytest.approx(MAX_NORM, rel=1e-4)


ZERO_PP = dict(ranks_per_node=2, quantize_weights=True, hpz_size=2, quantize_gradients=True)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
def test_clipping_after_a_compiled_zeropp_step(pools, norm_type):
    # qgZ's int4 gradients differ from the unsharded ones: the global norm is that of the
    # gradients the ranks hold, gathered.
    for r in pools(4).run(clip_vs_unsharded, "gpt", norm_type, "aot_eager", ZERO_PP):
        assert r["torch"] == pytest.approx(r["own"], rel=1e-5)
        assert r["torch"] == pytest.approx(r["unsharded"], rel=0.05)
        assert r["after"] == pytest.approx(MAX_NORM, rel=1e-4)


def nonfinite_clip() -> dict:
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"))
    x, y = batch("mlp", 4, 0)
    loss_of("mlp", model, x, y).backward()
    if dist.get_rank() == 1:  # one rank's chunk only: every rank must see it
        model.fc1.weight.grad.to_local()[0, 0] = float("nan")
    result = {}
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=True)
        result["error"] = "no error"
    except RuntimeError as error:
        result["error"] = str(error)
    total = zpp_compile.clip_grad_norm_(model.parameters(), MAX_NORM)
    result["nan_norm"] = math.isnan(total.item())
    result["nan_grads"] = bool(torch.isnan(model.fc2.weight.grad.to_local()).all())  # as torch: all nan
    return result


def test_nonfinite_gradients_fail_or_propagate_on_every_rank_as_torch_does(pools):
    for r in pools(2).run(nonfinite_clip):
        assert "is non-finite, so it cannot be clipped" in r["error"]
        assert r["nan_norm"] and r["nan_grads"]


# --------------------------------------------------------------------------------------------
# Writes through module attributes, nn.init, and reads outside forward

INITS = {
    "normal_": lambda t: nn.init.normal_(t, 0.1, 0.02),
    "uniform_": lambda t: nn.init.uniform_(t, -0.5, 0.5),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": nn.init.kaiming_normal_,
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "eye_": nn.init.eye_,
    "constant_": lambda t: nn.init.constant_(t, 0.25),
    "ones_": nn.init.ones_,
    "zeros_": nn.init.zeros_,
    "data.normal_": lambda t: t.data.normal_(mean=0.0, std=0.02),  # Hugging Face's _init_weights
    "bernoulli_": lambda t: t.data.bernoulli_(0.3),
    "randn_like": lambda t: t.copy_(torch.randn_like(t)),
}


def init_like_unsharded() -> dict[str, bool]:
    """Each nn.init function on a sharded 13x29 weight (uneven rows) gives the unsharded values."""
    equal = {}
    for label, init in INITS.items():
        torch.manual_seed(3)
        expected = nn.Linear(29, 13).weight
        torch.manual_seed(3)
        layer = zpp_compile.shard(nn.Linear(29, 13))
        torch.manual_seed(5)
        with torch.no_grad():
            init(expected)
        rng_after_unsharded = torch.get_rng_state()
        torch.manual_seed(5)
        with torch.no_grad():
            init(layer.weight)
        same_rng = torch.equal(torch.get_rng_state(), rng_after_unsharded)  # later draws unchanged too
        equal[label] = torch.equal(layer.weight.full_tensor(), expected.detach()) and same_rng
    return equal


@pytest.mark.parametrize("world", [2, 4])
def test_nn_init_on_a_sharded_parameter_gives_the_unsharded_values(pools, world):
    for rank, equal in enumerate(pools(world).run(init_like_unsharded)):
        assert all(equal.values()), f"rank {rank}: {[k for k, v in equal.items() if not v]}"


def orthogonal_init() -> str:
    layer = zpp_compile.shard(nn.Linear(29, 13))
    try:
        nn.init.orthogonal_(layer.weight)
    except NotImplementedError as error:  # DTensor cannot transpose in place: loud, not wrong
        return str(error)
    return "no error"


def test_an_init_dtensor_cannot_run_is_refused_not_silently_wrong(pools):
    for message in pools(2).run(orthogonal_init):
        assert "does not have a sharding strategy" in message


def module_inits_like_unsharded() -> dict[str, bool]:
    """reset_parameters() of modules (Embedding's padding row included) and a model's
    apply(init_fn), after shard(), against the same calls on the unsharded model."""
    results = {}
    for label, make, init in (
        ("embedding_padding_idx", lambda: nn.Embedding(11, 6, padding_idx=7), lambda m: m.reset_parameters()),
        ("linear_reset", lambda: nn.Linear(7, 5), lambda m: m.reset_parameters()),
        ("gpt_apply", lambda: build("gpt"), lambda m: m.apply(_init_weights)),
        ("hf_init_weights", lambda: build("hf_llama"), lambda m: m.init_weights()),
    ):
        torch.manual_seed(0)
        unsharded = make()
        sharded = zpp_compile.shard(copy.deepcopy(unsharded))
        torch.manual_seed(9)
        with torch.no_grad():
            init(unsharded)
        torch.manual_seed(9)
        with torch.no_grad():
            init(sharded)
        full = zpp_compile.full_state_dict(sharded)
        results[label] = all(torch.equal(full[k], v) for k, v in unsharded.state_dict().items())
    return results


def test_module_initialization_after_shard_gives_the_unsharded_values(pools):
    for rank, results in enumerate(pools(4).run(module_inits_like_unsharded)):
        assert all(results.values()), f"rank {rank}: {results}"


def writes_land_in_the_shard() -> dict:
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"))
    with torch.no_grad():
        nn.init.zeros_(model.fc1.weight)
        model.fc1.bias.mul_(0)
        model.fc2.weight.data.fill_(7)
        model.fc2.bias.copy_(torch.arange(7.0))  # a full tensor copied into a sharded parameter
    model.apply(lambda m: nn.init.constant_(m.weight, 0.5) if m is model.frozen else None)
    full = zpp_compile.full_state_dict(model)
    return {
        "zeros_": bool((full["fc1.weight"] == 0).all()),
        "mul_": bool((full["fc1.bias"] == 0).all()),
        "data.fill_": bool((full["fc2.weight"] == 7).all()),
        "copy_": torch.equal(full["fc2.bias"], torch.arange(7.0)),
        "apply": bool((full["frozen.weight"] == 0.5).all()),
    }


def test_writes_through_module_attributes_land_in_the_shard(pools):
    for results in pools(2).run(writes_land_in_the_shard):
        assert all(results.values()), results


def one_rank_reads() -> dict:
    """Rank 0 alone reads parameters outside forward: no collective, so no hang."""
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"))
    result = {}
    if dist.get_rank() == 0:
        with CommDebugMode() as comms, zpp_compile.comm_counter().trace() as issued:
            weight = model.fc1.weight
            result["is_parameter"] = weight is model.fc1._parameters["weight"]
            result["shape"] = tuple(weight.shape)
            result["local_norm"] = weight.to_local().norm().item()
            weight.norm()  # a DTensor still partial: nothing sent until its value is read
        result["collectives"] = comms.get_total_counts() + len(issued)
    dist.barrier()
    return result


def test_reading_a_parameter_outside_forward_is_local(pools):
    result = pools(2).run(one_rank_reads, timeout_s=60)[0]
    assert result["is_parameter"] and result["shape"] == (29, 13) and result["local_norm"] > 0
    assert result["collectives"] == 0


# --------------------------------------------------------------------------------------------
# Shapes


def shapes(name: str) -> dict:
    torch.manual_seed(0)
    unsharded = build(name)
    model = zpp_compile.shard(copy.deepcopy(unsharded))
    pairs = list(zip(model.named_parameters(), unsharded.named_parameters()))
    decay = [n for n, p in model.named_parameters() if p.dim() >= 2]  # nanoGPT's weight-decay group
    result = {
        "shape": all(p.shape == q.shape and p.dim() == q.dim() for (_, p), (_, q) in pairs),
        "numel": sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in unsharded.parameters()),
        "decay_group": decay == [n for n, p in unsharded.named_parameters() if p.dim() >= 2],
    }
    if name in HF_MODELS:
        result["num_parameters"] = model.num_parameters() == unsharded.num_parameters()
    return result


@pytest.mark.parametrize("name", ["mlp", "gpt", *HF_MODELS])
def test_parameters_report_their_global_shapes(pools, name):
    for result in pools(2).run(shapes, name):
        assert all(result.values()), result


# --------------------------------------------------------------------------------------------
# An exponential moving average of the weights (torch.optim.swa_utils.AveragedModel)


def ema_vs_unsharded(name: str, mode: str) -> dict:
    """AveragedModel deep-copies the sharded model and averages shard into shard: after two AdamW
    steps its weights and its forward equal the unsharded model's average, not the live model's."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    world, rank = dist.get_world_size(), dist.get_rank()
    model, run, opt, reference, ref_opt = sharded_with_reference(
        name, mode, zpp_compile.Config(lowering=lowering_of(mode))
    )
    ema, ref_ema = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (model, reference))
    for step in range(2):
        x, y = batch(name, 2 * world, step)
        loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        loss_of(name, reference, x, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        ema.update_parameters(model)
        ref_ema.update_parameters(reference)
    x, y = batch(name, 2 * world, 2)
    with torch.no_grad():
        losses = [loss_of(name, m, x, y).item() for m in (ema, ref_ema, model)]
    pairs = zip(ema.module.parameters(), ref_ema.module.parameters())
    return {
        "weight_error": max((_full(p.detach()) - q).abs().max().item() for p, q in pairs),
        "loss_gap": abs(losses[0] - losses[1]),
        "live_model_gap": abs(losses[0] - losses[2]),
        "sharded": all(isinstance(p, DTensor) for p in ema.module.parameters()),
    }


@pytest.mark.parametrize("name, mode", [("gpt", "eager"), ("hf_gpt2", "compiled")])
def test_an_ema_of_a_sharded_model_equals_the_unsharded_models_ema(pools, name, mode):
    for result in pools(2).run(ema_vs_unsharded, name, mode):
        assert result["sharded"], result  # the average holds shards, not full copies
        assert result["weight_error"] <= 1e-4, result
        assert result["loss_gap"] <= 1e-5, result
        assert result["live_model_gap"] > 1e-3, result  # its forward reads its own weights


# --------------------------------------------------------------------------------------------
# Loss scaling (torch.amp.GradScaler): an overflow in one rank's shard skips the step everywhere


def tiny_clip() -> nn.Module:
    """HF CLIP: its root holds `logit_scale`, a 0-d parameter (replicated), so it comes first in
    parameters() and in GradScaler's list of gradients."""
    import transformers as hf

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    return hf.CLIPModel(
        hf.CLIPConfig(
            text_config=dict(vocab_size=64, max_position_embeddings=16, **tower),
            vision_config=dict(image_size=8, patch_size=4, **tower),
            projection_dim=16,
        )
    )


def _scaled_loss_inputs(name: str, step: int) -> tuple:
    world = dist.get_world_size()
    if name != "hf_clip":
        return batch(name, 2 * world, step)
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (2 * world, 16), generator=g), torch.randn(2 * world, 3, 8, 8, generator=g)


def _scaled_loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "hf_clip":
        return model(input_ids=x, pixel_values=y, return_loss=True).loss
    return loss_of(name, model, x, y)


def grad_scaler_vs_unsharded(name: str, mode: str, scaler_class: str = "amp") -> dict:
    """Three SGD steps under torch.amp.GradScaler, sharded and unsharded, each rank on its own
    micro-batch (the reference averages its gradients as the reduce-scatter does). At step 1 the
    first sharded weight's element [0, 0] overflows: in the sharded model only rank 0 holds it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build(name) if name != "hf_clip" else tiny_clip()
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, zpp_compile.Config(lowering=lowering_of(mode)))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    # SGD: Adam's first steps move each weight by about lr whatever its gradient's size, so
    # Inductor's rounding of a near-zero gradient would show up as a difference of 2 * lr.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    sharded_scaler = ShardedGradScaler if scaler_class == "fsdp" else torch.amp.GradScaler
    scalers = [sharded_scaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)]
    overflowing = next(n for n, p in model.named_parameters() if not isinstance(p.placements[0], Replicate))
    result = {"scales": [], "stepped": [], "weight_error": 0.0}
    for step in range(3):
        x, y = _scaled_loss_inputs(name, step)
        for m, scaler in zip((run, reference), scalers):
            scaler.scale(_scaled_loss(name, m, x.chunk(world)[rank], y.chunk(world)[rank])).backward()
        for p in reference.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        if step == 1:
            reference.get_parameter(overflowing).grad[0, 0] = INF
            if rank == 0:
                model.get_parameter(overflowing).grad.to_local()[0, 0] = INF
        before = model.get_parameter(overflowing).to_local().clone()
        for opt, scaler in zip(opts, scalers):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        result["stepped"].append(not torch.equal(before, model.get_parameter(overflowing).to_local()))
        result["scales"].append([s.get_scale() for s in scalers])
        full = zpp_compile.full_state_dict(model)
        for key, expected in reference.state_dict().items():
            result["weight_error"] = max(result["weight_error"], (full[key] - expected).abs().max().item())
    return result


@pytest.mark.parametrize(
    "name, mode, scaler",
    [
        ("mlp", "eager", "amp"),
        ("mlp", "inductor", "amp"),
        ("hf_clip", "eager", "amp"),
        ("hf_clip", "inductor", "amp"),
        ("mlp", "eager", "fsdp"),  # FSDP's ShardedGradScaler all-reduces the check itself
    ],
)
def test_grad_scaler_skips_an_overflowing_step_on_every_rank(pools, name, mode, scaler):
    # OddMLP and CLIP hold a replicated 0-d parameter first: stock DTensor's overflow check then
    # leaves each rank its own answer (rank 0 skips, rank 1 steps, their scales part).
    for rank, r in enumerate(pools(2).run(grad_scaler_vs_unsharded, name, mode, scaler)):
        assert r["stepped"] == [True, False, True], f"rank {rank}: {r}"
        assert r["scales"] == [[1024.0, 1024.0], [512.0, 512.0], [512.0, 512.0]], f"rank {rank}: {r}"
        assert r["weight_error"] <= 5e-6, f"rank {rank}: {r}"  # Inductor: 5e-7 (CLIP)


# --------------------------------------------------------------------------------------------
# Full state dicts, Hugging Face save_pretrained / from_pretrained


def full_state_dicts(name: str, folder: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    unsharded = build(name)
    model = zpp_compile.shard(copy.deepcopy(unsharded), zpp_compile.Config(lowering="aot_eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(name, 2 * world, 0)
    loss_of(name, torch.compile(model, backend="zeropp"), x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    opt.step()
    full, optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    expected = zpp_compile.full_state_dict(model)
    result = {
        "model_full": all(type(v) is torch.Tensor for v in full.values())
        and all(torch.equal(full[k], v) for k, v in expected.items()),
        "optim_full": all(
            type(v) is torch.Tensor and (v.shape == unsharded.get_parameter(fqn).shape or v.dim() == 0)
            for fqn, state in optim["state"].items()
            for v in state.values()
        ),
    }
    # Load the full state dict, and a sharded one, into fresh sharded models: the same values.
    for form, options in (("full", StateDictOptions(full_state_dict=True)), ("sharded", StateDictOptions())):
        sd, osd = get_state_dict(model, opt, options=options)
        torch.manual_seed(1)
        other = zpp_compile.shard(build(name))
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        set_state_dict(other, other_opt, model_state_dict=sd, optim_state_dict=osd, options=options)
        got = zpp_compile.full_state_dict(other)
        state = other_opt.state[other.get_parameter(next(iter(optim["state"])))]
        result[f"set_{form}"] = all(torch.equal(got[k], v) for k, v in expected.items()) and "exp_avg" in state
    if name in HF_MODELS:
        model.save_pretrained(folder)  # every rank calls it; rank 0 writes the full model
        dist.barrier()
        reloaded = type(unsharded).from_pretrained(folder)
        result["save_pretrained"] = all(torch.equal(reloaded.state_dict()[k], v) for k, v in expected.items())
    return result


@pytest.mark.parametrize("name", ["gpt", *HF_MODELS])
def test_full_state_dicts_and_save_pretrained_hold_full_tensors(pools, tmp_path, name):
    for result in pools(2).run(full_state_dicts, name, str(tmp_path / "hf")):
        assert all(result.values()), result


# --------------------------------------------------------------------------------------------
# DistributedDataParallel around a sharded model


def wrap_in_ddp() -> str:
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"))
    before = model.fc1.weight.to_local().clone()
    try:
        torch.nn.parallel.DistributedDataParallel(model)
        message = "no error"
    except zpp_compile.ShardingError as error:
        message = str(error)
    assert torch.equal(model.fc1.weight.to_local(), before), "DDP overwrote a shard"
    return message


def test_wrapping_a_sharded_model_in_ddp_is_refused_with_the_recipe(pools):
    for message in pools(2).run(wrap_in_ddp):
        assert "DistributedDataParallel" in message and "broadcast rank 0's shards" in message
        assert "README" in message


def hugging_face_trainer(folder: str) -> dict:
    """Trainer under a 2-rank process group, as torchrun would launch it: no DDP wrap, the global
    gradient norm logged, the sharded model trained, and save_model writes the full model."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = zpp_compile.shard(build("hf_gpt2"))
    before = zpp_compile.full_state_dict(model)
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=2, max_steps=3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, max_grad_norm=1.0,
    )  # fmt: skip
    with torchrun_environment():
        trainer = Trainer(model=model, args=args, train_dataset=trainer_dataset())
        result = trainer.train()
        trainer.save_model(os.path.join(folder, "final"))  # every rank, as a script calls it
    after = zpp_compile.full_state_dict(model)
    dist.barrier()
    saved = type(model).from_pretrained(os.path.join(folder, "final")).state_dict()
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "loss": result.training_loss,
        "grad_norms": norms,
        "trained": not torch.equal(
            after["transformer.h.0.attn.c_attn.weight"], before["transformer.h.0.attn.c_attn.weight"]
        ),
        "saved_bitwise": all(torch.equal(saved[k], v) for k, v in after.items()),
    }


def test_hugging_face_trainer_trains_a_sharded_model_without_ddp(pools, tmp_path):
    results = pools(2).run(hugging_face_trainer, str(tmp_path / "trainer"))
    for r in results:
        assert r["wrapped"] == "GPT2LMHeadModel" and r["trained"] and len(r["grad_norms"]) == 3
        assert r["saved_bitwise"], r  # from_pretrained reads back the trained model
    assert results[0]["loss"] == results[1]["loss"]  # the same logged loss on every rank
    assert results[0]["grad_norms"] == results[1]["grad_norms"]  # the global norm, not each rank's


def trainer_log(folder: str, compiled: bool) -> dict:
    """Trainer with gradient accumulation on the sharded HF GPT-2, eager or compiled in place
    (`model.compile(backend="zeropp")`: the module keeps its forward's signature, by which Trainer
    picks the dataset's columns)."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = zpp_compile.shard(build("hf_gpt2"))
    if compiled:
        model.compile(backend="zeropp")
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, max_grad_norm=1.0,
    )  # fmt: skip
    graphs_before = len(zpp_compile.compiled_graphs())
    with torchrun_environment():
        trainer = Trainer(model=model, args=args, train_dataset=trainer_dataset())
        trainer.train()
    history = trainer.state.log_history
    return {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
        "zeropp_graphs": len(zpp_compile.compiled_graphs()) - graphs_before,
    }


def test_hugging_face_trainer_runs_the_model_compiled_in_place_as_eager(pools, tmp_path):
    eager = pools(2).run(trainer_log, str(tmp_path / "eager"), False)[0]
    compiled = pools(2).run(trainer_log, str(tmp_path / "compiled"), True)[0]
    assert eager["zeropp_graphs"] == 0 and compiled["zeropp_graphs"] > 0, compiled
    assert len(compiled["losses"]) == 3, compiled
    for key in ("losses", "grad_norms"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-5), (eager, compiled)
