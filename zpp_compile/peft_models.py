"""PEFT models built on the meta device: their adapters initialized as PEFT does, the base model's
weights loaded under the base model's own names.

A LoRA model too large for one rank is built as any other (`get_peft_model` on a meta-device
model, then shard(), then materialize() or load_safetensors()), with two catches this module
takes care of:

- Initialization. PEFT initializes each adapter when it creates it: `lora_B` zero, so that the
  adapted model starts as the pretrained one, `lora_A` by `LoraConfig.init_lora_weights`. On the
  meta device that wrote nothing, and the initialization materialize() runs afterwards treats
  `lora_A`/`lora_B` as the plain `nn.Linear`s they are (`reset_parameters()`, or Hugging Face's
  `_init_weights`): a random `lora_B`, and fine-tuning would start from a changed model with no
  error. So after any initialization, each LoRA layer's adapters get PEFT's own
  `reset_lora_parameters`, and each `modules_to_save` copy the values of the module it copies.
- Names. The PEFT model names a base weight `base_model.model.<name>`, with `.base_layer` inside
  each adapted layer and `.original_module` inside each module to save; a checkpoint of the base
  model has `<name>`. Loading maps each weight to its checkpoint name; adapters come from no
  checkpoint.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from .layout import ShardingError

PEFT_PREFIX = "base_model.model."
_WRAPPER_SEGMENTS = ("base_layer", "original_module")  # PEFT's module between the layer and its weight
_ADAPTER_SEGMENTS = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "modules_to_save",
)


def is_peft_model(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def checkpoint_name(peft_name: str) -> Optional[str]:
    """The base model's name of a PEFT model's parameter or buffer; None for an adapter's own
    (LoRA matrices, the trainable copy of a module to save), which no base checkpoint holds.

    "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" ->
    "model.layers.0.self_attn.q_proj.weight"."""
    parts = peft_name.removeprefix(PEFT_PREFIX).split(".")
    if any(part in _ADAPTER_SEGMENTS for part in parts):
        return None
    return ".".join(part for part in parts if part not in _WRAPPER_SEGMENTS)


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """Each LoRA adapter initialized as get_peft_model creates it (its nn.Linear matrices' own
    init, then PEFT's reset_lora_parameters with the config's init_lora_weights: the same random
    draws in the same order, so the unsharded model seeded alike gets the same values; LoRA on an
    embedding, whose matrices PEFT first draws with torch.randn, gets PEFT's distributions but not
    its exact draws), and each modules_to_save copy set to the module it copies (see above)."""
    for module in model.modules():
        if callable(getattr(module, "reset_lora_parameters", None)):
            for adapter in _adapters_of(module):
                init = _lora_init(model, adapter)
                for matrices in (module.lora_A, module.lora_B):  # as PEFT creates them: nn.Linear first
                    if adapter in matrices:
                        matrices[adapter].reset_parameters()
                module.reset_lora_parameters(adapter, init)
    copy_modules_to_save(model)


@torch.no_grad()
def copy_modules_to_save(model: nn.Module) -> None:
    """Each trainable copy PEFT keeps of a module to save starts as that module (PEFT deep-copies
    it when it wraps it)."""
    for module in model.modules():
        copies = getattr(module, "modules_to_save", None)
        original = getattr(module, "original_module", None)
        if isinstance(copies, nn.ModuleDict) and isinstance(original, nn.Module):
            for copy in copies.values():
                for target, source in zip(copy.parameters(), original.parameters()):
                    target.copy_(source)


def _adapters_of(layer: nn.Module) -> list[str]:
    names = [*getattr(layer, "lora_A", {}).keys(), *getattr(layer, "lora_embedding_A", {}).keys()]
    return list(dict.fromkeys(names))


def _lora_init(model: nn.Module, adapter: str) -> object:
    """The adapter's init_lora_weights where reset_lora_parameters redoes it (True, False,
    "gaussian"); the others (PiSSA, LoftQ, EVA, ... and DoRA's magnitudes) derive the adapter from
    the base weights when PEFT creates it, which on the meta device wrote nothing."""
    config = model.peft_config[adapter]
    init = config.init_lora_weights
    plain = init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")
    if not plain or getattr(config, "use_dora", False):
        what = "use_dora=True" if plain else f"init_lora_weights={init!r}"
        raise ShardingError(
            f"LoraConfig({what}) of adapter {adapter!r}: PEFT computes that adapter from the base model's "
            "weights when it creates it, and a model built on the meta device had none. Use "
            "init_lora_weights=True or 'gaussian' without DoRA on the meta device, or build the PEFT model "
            "from the loaded base model."
        )
    return init
