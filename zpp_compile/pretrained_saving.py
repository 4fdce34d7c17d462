"""`save_pretrained` on a sharded model writes what the unsharded model's would.

transformers' `PreTrainedModel.save_pretrained(dir)` and PEFT's `PeftModel.save_pretrained(dir)`
read `model.state_dict()`, which on a sharded model holds DTensor shards. shard() wraps both so
that they write full tensors. Each is collective: call it on every rank, as with FSDP, and pass a
`state_dict` on every rank or on none (a `state_dict` the caller passes is written as given).

- A transformers model (the root, and each outermost one inside it: the model a sharded PEFT
  model's `merge_and_unload()` hands back) gathers its whole state dict on rank 0; transformers
  itself writes on rank 0 only. Another root with a `config` is wrapped where its save_pretrained
  takes a `state_dict`.
- A PEFT model gathers only the entries PEFT writes (for LoRA the adapter, not the frozen base
  model: a LoRA adapter of a 7B model is megabytes, its base model 28 GB in fp32), and writes on
  rank 0 only: PEFT's own `is_main_process` defaults to True on every rank, and every rank but 0
  holds no values to write. Which entries PEFT writes comes from a dry run of PEFT's own selection
  on rank 0, on meta tensors of the global shapes; its answer (and PEFT's "auto" choice of saving
  the embeddings, which reads the base model's config from disk or the Hub) is broadcast, so that
  every rank gathers the same entries and PEFT's real call decides nothing again.

The wrappers are hugging_face.InstanceMethod objects: a deep copy of the model (an EMA, a
reference model) gets wrappers bound to the copy.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .hugging_face import InstanceMethod, outermost_transformers_models
from .layout import state_dict_tensors, state_of_part
from .peft_models import is_peft_model

Gather = Callable[..., dict[str, torch.Tensor]]  # sharding.full_state_dict, which imports this module


def install_pretrained_saving(model: nn.Module, gather: Gather) -> None:
    """Wrap the save_pretrained of `model` and of the transformers models inside it (see above);
    `gather` is full_state_dict."""
    if is_peft_model(model):
        _bind_save_pretrained(model, _save_adapter, gather)
    elif hasattr(model, "config") and _takes_state_dict(model):
        _bind_save_pretrained(model, _save_full_model, gather)
    for name, inner in outermost_transformers_models(model):
        if name:  # the root is settled above
            _bind_save_pretrained(inner, _save_full_model, gather)


def _takes_state_dict(model: nn.Module) -> bool:
    method = getattr(type(model), "save_pretrained", None)
    return callable(method) and "state_dict" in inspect.signature(method).parameters


def _bind_save_pretrained(model: nn.Module, save: Callable[..., Any], gather: Gather) -> None:
    method = getattr(type(model), "save_pretrained", None)
    if callable(method):
        model.save_pretrained = InstanceMethod(save, model, gather, method.__doc__)


def _save_full_model(gather: Gather, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).save_pretrained
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    if bound.arguments.get("state_dict") is None:
        bound.arguments["state_dict"] = gather(self, rank0_only=True)
    return original(*bound.args, **bound.kwargs)


def _save_adapter(gather: Gather, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).save_pretrained
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    extra = bound.arguments["kwargs"]
    if extra.get("state_dict") is None:
        selected, embeddings = bound.arguments["selected_adapters"], bound.arguments["save_embedding_layers"]
        names, embeddings = _agreed_selection(self, selected, embeddings)
        bound.arguments["save_embedding_layers"] = embeddings
        extra["state_dict"] = _adapter_state_dict(self, gather, names)
        bound.arguments["is_main_process"] = bound.arguments["is_main_process"] and _rank(self) == 0
    return original(*bound.args, **bound.kwargs)


def _rank(model: nn.Module) -> int:
    return state_of_part(model).topology.rank


def _agreed_selection(model: nn.Module, selected: Any, embeddings: Any) -> tuple[Optional[set[str]], bool]:
    """Rank 0's answer, broadcast: the names PEFT writes, and whether with the embeddings."""
    answer: list[Any] = [None]
    if _rank(model) == 0:
        answer = [_selection(model, selected, embeddings)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _selection(model: nn.Module, selected: Any, embeddings: Any) -> tuple[Optional[set[str]], bool]:
    """The names PEFT writes, and save_embedding_layers as a bool: "auto" asks PEFT's own rule
    once, and is True where it adds entries to what PEFT writes without the embeddings."""
    placeholders = meta_state_dict(model)
    names = names_peft_saves(model, selected, embeddings, placeholders)
    if embeddings != "auto":
        return names, bool(embeddings)
    return names, names != names_peft_saves(model, selected, False, placeholders)


def _adapter_state_dict(model: nn.Module, gather: Gather, names: Optional[set[str]]) -> dict:
    """Rank 0: the selected entries, gathered. The other ranks: the same names over meta tensors
    (PEFT checks that a module's entries are all there, `modules_to_save`, before it looks at
    is_main_process)."""
    gathered = gather(model, rank0_only=True, names=names)
    if _rank(model) == 0:
        return gathered
    placeholders = meta_state_dict(model)
    return placeholders if names is None else {name: placeholders[name] for name in names}


def meta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The names full_state_dict gives, over meta tensors of the global shapes and dtypes: the
    parameters and persistent buffers found by walking the modules, so no value is read (the
    state-dict hooks would dequantize every int8 frozen weight's shard)."""
    return {fqn: torch.empty(t.shape, dtype=t.dtype, device="meta") for fqn, _, _, t in state_dict_tensors(model)}


def names_peft_saves(
    model: nn.Module,
    selected_adapters: Optional[list[str]],
    save_embedding_layers: Any,
    placeholders: Optional[dict[str, torch.Tensor]] = None,
) -> Optional[set[str]]:
    """The state-dict names PEFT's save_pretrained writes for `model`: PEFT's own
    get_peft_model_state_dict run on meta tensors of the global shapes (it picks entries by name
    and config, not by value). None, meaning every name, where it returns a tensor it computed
    rather than one it picked (PEFT types other than LoRA may)."""
    from peft.utils import get_peft_model_state_dict  # noqa: PLC0415  (only for PEFT models)

    placeholders = meta_state_dict(model) if placeholders is None else placeholders
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
