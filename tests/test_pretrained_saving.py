"""save_pretrained on sharded models: PEFT (LoRA) adapters, merged models (pretrained_saving.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.pretrained_saving import names_peft_saves

from .models import _adamw, batch, build, gradient_errors, loss_of, torchrun_environment, trainer_dataset

LORA_TARGETS = {"hf_llama": ["q_proj", "v_proj", "down_proj"], "hf_gpt2": ["c_attn", "c_proj"]}
RTOL = 1e-5


def _lora_model(name: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[name], fan_in_fan_out=name == "hf_gpt2"
    )
    return get_peft_model(build(name), lora)


def _train_beside_reference(name: str, mode: str, config: zpp_compile.Config, checkpointing: bool = False) -> tuple:
    """A LoRA model sharded with `config`, and its unsharded copy holding the weights the sharded
    one computes with (int8 frozen weights dequantized); two AdamW steps of each. `checkpointing`:
    HF gradient checkpointing, as PEFT's fine-tuning recipes set it up."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _lora_model(name)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # the frozen embedding's output must require grad
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, config)
    reference.load_state_dict(zpp_compile.full_state_dict(model))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    opt, ref_opt = _adamw(model, 1e-2), _adamw(reference, 1e-2)
    errors: dict[str, float] = {}
    for step in range(2):
        x, _ = batch(name, 2 * world, step)
        loss_of(name, run, x.chunk(world)[rank], None).backward()
        loss_of(name, reference, x, None).backward()
        errors |= gradient_errors(model, reference, step)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return model, reference, errors


def lora_fine_tuning(name: str, mode: str, config: dict, folder: str) -> dict:
    """Train a LoRA adapter sharded, save it with PeftModel.save_pretrained on every rank (each rank
    into its own folder, so that what rank 1 writes is seen, not raced over), load rank 0's."""
    from peft import PeftModel  # noqa: PLC0415

    rank = dist.get_rank()
    config = dict(config)
    checkpointing = config.pop("checkpointing", False)
    model, reference, errors = _train_beside_reference(name, mode, zpp_compile.Config(**config), checkpointing)
    adapter = {n for n, p in model.named_parameters() if p.requires_grad}
    ours = os.path.join(folder, f"rank{rank}")
    asked: list = []  # what save_pretrained asks full_state_dict to gather (it still gathers it)
    model.save_pretrained.extra = lambda m, **kw: asked.append(kw["names"]) or zpp_compile.full_state_dict(m, **kw)
    model.save_pretrained(ours)
    gathered = zpp_compile.full_state_dict(model, names=adapter)
    dist.barrier()
    loaded = PeftModel.from_pretrained(build(name), os.path.join(folder, "rank0")).state_dict()
    expected = reference.state_dict()
    return {
        "grad_error": max(errors.values()),
        "adapter_only": asked == [adapter] and names_peft_saves(model, None, "auto") == adapter,
        "wrote": sorted(os.listdir(ours)),
        "loaded_bitwise": all(torch.equal(loaded[k], v) for k, v in gathered.items()),
        "adapter_error": max((v - expected[k]).abs().max().item() for k, v in gathered.items()),
    }


@pytest.mark.parametrize(
    "name, mode, config",
    [
        ("hf_llama", "eager", {}),
        ("hf_gpt2", "compiled", {}),
        ("hf_llama", "compiled", {"quantize_frozen_weights": True, "checkpointing": True}),
    ],
    ids=["llama-eager", "gpt2-inductor", "llama-inductor-int8-base-checkpointing"],
)
def test_a_lora_adapter_trains_like_unsharded_and_rank0_alone_saves_it(pools, tmp_path, name, mode, config):
    results = pools(2).run(lora_fine_tuning, name, mode, config, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["grad_error"] <= RTOL, result
        assert result["adapter_only"], result  # only the adapter is gathered, not the base model
        assert result["loaded_bitwise"], result  # from_pretrained reads back what was trained
        assert result["adapter_error"] <= 1e-5, result
        if rank == 0:
            assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["wrote"]), result
        else:  # peft writes on every rank by default; any rank but 0 would write an empty adapter
            assert result["wrote"] == [], result


def merged_model(folder: str) -> dict:
    """merge_and_unload() of a sharded LoRA model: the transformers model inside, still sharded;
    its weights, full_state_dict and save_pretrained are those of the merged unsharded model."""
    model, reference, _ = _train_beside_reference("hf_llama", "eager", zpp_compile.Config())
    expected = reference.merge_and_unload().state_dict()
    merged = model.merge_and_unload()
    full = zpp_compile.full_state_dict(merged)
    merged.save_pretrained(folder)
    dist.barrier()
    saved = type(merged).from_pretrained(folder).state_dict()
    x, _ = batch("hf_llama", 2, 5)
    with torch.no_grad():
        losses = [loss_of("hf_llama", m, x, None).item() for m in (merged, reference)]
    return {
        "same_names": full.keys() == expected.keys(),
        "merge_error": max((v - expected[k]).abs().max().item() for k, v in full.items()),
        "saved_bitwise": all(torch.equal(saved[k], v) for k, v in full.items()),
        "loss_gap": abs(losses[0] - losses[1]),
    }


def deep_copy_saves_itself(folder: str) -> dict:
    """A deep copy of a sharded model (an EMA, TRL's reference model) saves, and generates with,
    its own weights: the adapted methods are bound to the copy, not to the original."""
    from peft import PeftModel  # noqa: PLC0415

    model = zpp_compile.shard(_lora_model("hf_llama"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    twin.save_pretrained(folder)
    adapter = {n for n, p in twin.named_parameters() if p.requires_grad}
    own = zpp_compile.full_state_dict(twin, names=adapter)
    dist.barrier()
    loaded = PeftModel.from_pretrained(build("hf_llama"), folder).state_dict()
    inner = twin.get_base_model()
    return {
        "saved_the_copy": all(torch.equal(loaded[k], v) for k, v in own.items()),
        "methods_bound_to_copy": inner.generate.module is inner and inner.save_pretrained.module is inner,
    }


def test_a_deep_copy_of_a_sharded_model_saves_its_own_weights(pools, tmp_path):
    for result in pools(2).run(deep_copy_saves_itself, str(tmp_path / "twin")):
        assert all(result.values()), result


def test_a_merged_lora_model_gathers_and_saves_the_merged_weights(pools, tmp_path):
    for result in pools(2).run(merged_model, str(tmp_path / "merged")):
        assert result["same_names"] and result["saved_bitwise"], result
        assert result["merge_error"] <= 1e-5 and result["loss_gap"] <= 1e-5, result


def lora_with_trainer(folder: str) -> dict:
    """Hugging Face Trainer on a sharded PEFT model: not wrapped in DDP (the PEFT model answers
    Trainer from the transformers model inside), a checkpoint every 2 steps and save_model, each
    the adapter alone, written once."""
    from peft import PeftModel  # noqa: PLC0415
    from transformers import Trainer, TrainingArguments  # noqa: PLC0415

    model = zpp_compile.shard(_lora_model("hf_gpt2"))
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=2, max_steps=4, logging_steps=1, save_strategy="steps",
        save_steps=2, save_only_model=True, report_to=[], use_cpu=True,
    )  # fmt: skip
    with torchrun_environment():
        trainer = Trainer(model=model, args=args, train_dataset=trainer_dataset())
        trainer.train()
        trainer.save_model(os.path.join(folder, "final"))
    adapter = {n for n, p in model.named_parameters() if p.requires_grad}
    trained = zpp_compile.full_state_dict(model, names=adapter)
    dist.barrier()
    loaded = PeftModel.from_pretrained(build("hf_gpt2"), os.path.join(folder, "final")).state_dict()
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "saved": sorted(
            d for d in os.listdir(folder) if "adapter_model.safetensors" in os.listdir(os.path.join(folder, d))
        ),
        "final_bitwise": all(torch.equal(loaded[k], v) for k, v in trained.items()),
    }


def test_hugging_face_trainer_trains_and_saves_a_sharded_lora_adapter(pools, tmp_path):
    for result in pools(2).run(lora_with_trainer, str(tmp_path / "trainer")):
        assert result["wrapped"] == "PeftModel", result  # not DistributedDataParallel
        assert result["saved"] == ["checkpoint-2", "checkpoint-4", "final"], result
        assert result["final_bitwise"], result


def _classifier() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification  # noqa: PLC0415

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config)


def classifier_with_lora(folder: str) -> dict:
    """LoRA for sequence classification: the new head is trained whole beside the adapter (PEFT's
    modules_to_save) and saved with it; PEFT applied after shard() is refused with the order."""
    from peft import LoraConfig, PeftModel, get_peft_model  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS", lora_dropout=0.0)
    model = get_peft_model(_classifier(), lora)
    reference = copy.deepcopy(model)
    run = torch.compile(zpp_compile.shard(model), backend="zeropp")
    opt, ref_opt = _adamw(model, 1e-2), _adamw(reference, 1e-2)
    g = torch.Generator().manual_seed(1)
    errors: dict[str, float] = {}
    for step in range(2):
        x, y = torch.randint(1, 64, (2 * world, 12), generator=g), torch.randint(0, 3, (2 * world,), generator=g)
        run(input_ids=x.chunk(world)[rank], labels=y.chunk(world)[rank]).loss.backward()
        reference(input_ids=x, labels=y).loss.backward()
        errors |= gradient_errors(model, reference, step)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    model.save_pretrained(folder)
    trained = zpp_compile.full_state_dict(model, names={n for n, p in model.named_parameters() if p.requires_grad})
    dist.barrier()
    loaded = PeftModel.from_pretrained(_classifier(), folder).state_dict()
    late = get_peft_model(zpp_compile.shard(_classifier()), lora)
    try:
        late(input_ids=x.chunk(world)[rank], labels=y.chunk(world)[rank])
        refusal = "no error"
    except zpp_compile.ShardingError as error:
        refusal = str(error)
    return {
        "grad_error": max(errors.values()),
        "head_saved": any("score.modules_to_save" in k for k in trained),
        "loaded_bitwise": all(torch.equal(loaded[k], v) for k, v in trained.items()),
        "refusal": refusal,
    }


def test_a_lora_classifier_saves_its_trained_head_and_peft_after_shard_is_refused(pools, tmp_path):
    for result in pools(2).run(classifier_with_lora, str(tmp_path / "classifier")):
        assert result["grad_error"] <= RTOL and result["head_saved"] and result["loaded_bitwise"], result
        assert "get_peft_model(model, config) first, then zpp_compile.shard(model)" in result["refusal"], result
