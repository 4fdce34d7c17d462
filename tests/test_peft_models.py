"""PEFT (LoRA) models built on the meta device: adapters initialized as PEFT does, the base
checkpoint loaded under its own names (zpp_compile/peft_models.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.peft_models import checkpoint_name

from .models import batch, build, loss_of
from .test_pretrained_saving import _classifier


def test_checkpoint_names_drop_peft_wrappers_and_adapters():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_name("base_model.model.score.original_module.weight") == "score.weight"
    assert checkpoint_name("base_model.model.model.norm.weight") == "model.norm.weight"
    for adapter in ("q_proj.lora_A.default.weight", "score.modules_to_save.default.weight", "lora_magnitude_vector"):
        assert checkpoint_name(f"base_model.model.model.{adapter}") is None


def _lora(**kwargs):
    from peft import LoraConfig  # noqa: PLC0415

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **kwargs)


def meta_lora_loads_its_base(folder: str) -> dict:
    """A LoRA Llama built on the meta device, sharded, then given the base model's checkpoint:
    bitwise what get_peft_model gives on from_pretrained with the same seed, adapters included."""
    from peft import get_peft_model  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    base = build("hf_llama")
    if dist.get_rank() == 0:
        base.save_pretrained(folder)
    dist.barrier()
    torch.manual_seed(7)
    expected = get_peft_model(LlamaForCausalLM.from_pretrained(folder), _lora()).state_dict()
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(base.config), _lora())
    zpp_compile.shard(model)
    torch.manual_seed(7)  # the adapters draw what get_peft_model drew after this seed
    zpp_compile.load_safetensors(model, folder)
    loaded = zpp_compile.full_state_dict(model)
    x, _ = batch("hf_llama", 2, 0)
    with torch.no_grad():
        gap = abs(loss_of("hf_llama", model, x, None).item() - loss_of("hf_llama", base, x, None).item())
    return {
        "same_names": loaded.keys() == expected.keys(),
        "differing": [k for k, v in expected.items() if not torch.equal(loaded[k], v)],
        "loss_gap": gap,  # lora_B is zero: the adapted model starts as the pretrained one
    }


def test_a_meta_lora_model_loads_its_base_checkpoint_as_peft_on_from_pretrained(pools, tmp_path):
    for result in pools(2).run(meta_lora_loads_its_base, str(tmp_path / "base")):
        assert result["same_names"] and result["differing"] == [], result
        assert result["loss_gap"] == 0.0, result


def materialized_adapters() -> dict:
    """materialize() of a meta LoRA classifier (an adapter and a head trained whole) with Hugging
    Face's init, which draws lora_B as any nn.Linear: the adapters start as PEFT starts them
    (lora_B zero), and the head's trainable copy equals the head."""
    from peft import get_peft_model  # noqa: PLC0415

    with torch.device("meta"):
        model = get_peft_model(_classifier(), _lora(task_type="SEQ_CLS"))
    zpp_compile.shard(model)
    torch.manual_seed(0)
    zpp_compile.materialize(model, init=lambda m: m.get_base_model().init_weights())
    full = zpp_compile.full_state_dict(model)
    lora_a = [v for k, v in full.items() if "lora_A" in k]
    x = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(input_ids=x).logits
        with model.disable_adapter():
            plain = model(input_ids=x).logits
    return {
        "lora_b_zero": all(bool((v == 0).all()) for k, v in full.items() if "lora_B" in k),
        "lora_a_drawn": bool(lora_a) and all(bool(v.abs().sum() > 0) for v in lora_a),
        "head_copied": torch.equal(
            full["base_model.model.score.modules_to_save.default.weight"],
            full["base_model.model.score.original_module.weight"],
        ),
        "starts_as_base": torch.equal(adapted, plain),
    }


def test_materialize_starts_lora_adapters_as_peft_does(pools):
    for result in pools(2).run(materialized_adapters):
        assert all(result.values()), result


def derived_init_on_meta() -> str:
    from peft import get_peft_model  # noqa: PLC0415

    with torch.device("meta"):
        model = get_peft_model(build("hf_llama"), _lora(init_lora_weights="olora"))
    zpp_compile.shard(model)
    try:
        zpp_compile.materialize(model)
        return "no error"
    except zpp_compile.ShardingError as error:
        return str(error)


def test_a_lora_init_computed_from_base_weights_is_refused_on_the_meta_device(pools):
    for message in pools(2).run(derived_init_on_meta):
        assert "init_lora_weights='olora'" in message and "init_lora_weights=True or 'gaussian'" in message
