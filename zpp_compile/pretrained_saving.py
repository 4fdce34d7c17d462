"""`save_pretrained` on a sharded model writes what the unsharded model's would.

transformers' `PreTrainedModel.save_pretrained(dir)` and PEFT's `PeftModel.save_pretrained(dir)`
read `model.state_dict()`, which on a sharded model holds DTensor shards. shard() wraps both so
that they write full tensors. Each is collective: call it on every rank, as with FSDP.

- A transformers model (the root, and each outermost one inside it: the model a sharded PEFT
  model's `merge_and_unload()` hands back) gathers its whole state dict on rank 0; transformers
  itself writes on rank 0 only.
- A PEFT model gathers only the entries PEFT writes (the adapter, not the frozen base model: a
  LoRA adapter of a 7B model is megabytes, its base model 28 GB in fp32), and writes on rank 0
  only: PEFT's own `is_main_process` defaults to True on every rank, and every rank but 0 holds
  no state dict to write. Which entries PEFT writes comes from a dry run of PEFT's own selection
  on meta tensors of the global shapes.

A `state_dict` the caller passes is written as given.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from .hugging_face import outermost_of_class
from .layout import state_of_part
from .peft_models import is_peft_model

Gather = Callable[..., dict[str, torch.Tensor]]  # sharding.full_state_dict, which imports this module


def install_pretrained_saving(model: nn.Module, gather: Gather) -> None:
    """Wrap the save_pretrained of `model` and of the transformers models inside it (see above);
    `gather` is full_state_dict."""
    if is_peft_model(model):
        _wrap_save_pretrained(model, _adapter_saver(model, gather))
    elif hasattr(model, "config"):  # transformers-like, as PreTrainedModel or not
        _wrap_save_pretrained(model, _full_model_saver(model, gather))
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is not None:
        for name, inner in outermost_of_class(model, modeling_utils.PreTrainedModel):
            if name:  # the root is settled above
                _wrap_save_pretrained(inner, _full_model_saver(inner, gather))


Saver = Callable[[Callable[..., Any]], Callable[..., Any]]  # the original save_pretrained -> the wrapped one


def _wrap_save_pretrained(model: nn.Module, saver: Saver) -> None:
    original = getattr(model, "save_pretrained", None)
    if callable(original):
        wrapped = saver(original)
        wrapped.__doc__ = original.__doc__
        model.save_pretrained = wrapped


def _full_model_saver(model: nn.Module, gather: Gather) -> Saver:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
            if state_dict is None:
                state_dict = gather(model, rank0_only=True)
            return original(save_directory, *args, state_dict=state_dict, **kwargs)

        return save_pretrained

    return wrap


def _adapter_saver(model: nn.Module, gather: Gather) -> Saver:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def save_pretrained(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            extra = bound.arguments["kwargs"]
            if extra.get("state_dict") is None:
                chosen = bound.arguments["selected_adapters"], bound.arguments["save_embedding_layers"]
                extra["state_dict"] = _adapter_state_dict(model, gather, *chosen)
                rank = state_of_part(model).topology.rank
                bound.arguments["is_main_process"] = bound.arguments["is_main_process"] and rank == 0
            return original(*bound.args, **bound.kwargs)

        return save_pretrained

    return wrap


def _adapter_state_dict(model: nn.Module, gather: Gather, selected_adapters: Any, save_embedding_layers: Any) -> dict:
    """Rank 0: the entries PEFT writes, gathered. The other ranks: the same names over meta
    tensors (PEFT checks that a module's entries are all there, `modules_to_save`, before it looks
    at is_main_process)."""
    placeholders = _meta_state_dict(model)
    names = names_peft_saves(model, selected_adapters, save_embedding_layers, placeholders)
    gathered = gather(model, rank0_only=True, names=names)
    if state_of_part(model).topology.rank == 0:
        return gathered
    return placeholders if names is None else {name: placeholders[name] for name in names}


def _meta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict()'s names over meta tensors of the global shapes (no values read)."""
    return {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}


def names_peft_saves(
    model: nn.Module,
    selected_adapters: Optional[list[str]],
    save_embedding_layers: Any,
    placeholders: Optional[dict[str, torch.Tensor]] = None,
) -> Optional[set[str]]:
    """The state-dict names PEFT's save_pretrained writes for `model`: PEFT's own
    get_peft_model_state_dict run on meta tensors of the global shapes (it picks entries by name
    and config, not by value). None, meaning every name, where it returns a tensor it computed
    rather than one it picked."""
    from peft.utils import get_peft_model_state_dict  # noqa: PLC0415  (only for PEFT models)

    placeholders = _meta_state_dict(model) if placeholders is None else placeholders
    name_of = {id(t): name for name, t in placeholders.items()}
    names: set[str] = set()
    for adapter in selected_adapters or list(model.peft_config):
        picked = get_peft_model_state_dict(
            model, state_dict=placeholders, adapter_name=adapter, save_embedding_layers=save_embedding_layers
        )
        if any(id(value) not in name_of for value in picked.values()):
            return None
        names.update(name_of[id(value)] for value in picked.values())
    return names
