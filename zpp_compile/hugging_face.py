"""What shard() settles on a Hugging Face transformers model so that torch.compile traces it once.

transformers' `PreTrainedModel.loss_function` property looks the model's `loss_type` up in its
LOSS_MAPPING. A model whose class name names no loss there (`GPT2LMHeadModel`, ...) has
`loss_type = None`, and the property then calls `logger.warning_once` and falls back to
ForCausalLM, on every call. Under torch.compile that logging call is a graph break at the end of
the forward, inside the loss, below three frames (the output wrapper, the deprecation wrapper, the
model's forward): Dynamo traces the whole model once per frame only to give that frame up, then a
fourth time to compile it. Each trace of a sharded model traces every parameter read
(sharding.py), so this costs zeropp more than it costs DDP.

shard() gives such a model a `_loss_function` of its own, which the property returns before it
looks at `loss_type` (transformers' own override point: the `loss_function` setter writes it). It
is a FallbackLoss: the loss LOSS_MAPPING has for the model's loss_type when it has one, else the
ForCausalLM loss, as the property chooses, without the logging call. `loss_type` itself stays None:
transformers' Trainer reads it (a ForCausalLM loss_type makes it count label tokens differently,
which would scale the loss), so it must read what it reads for the unsharded model.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable, Iterator

from torch import nn

log = logging.getLogger(__name__)

FALLBACK_LOSS_TYPE = "ForCausalLM"  # what PreTrainedModel.loss_function falls back to


class FallbackLoss:
    """A model's loss as transformers' `loss_function` property picks it, without its warning.

    An object, not a closure: a model holding it still pickles and deep-copies (the copy's
    FallbackLoss reads the copy's loss_type)."""

    def __init__(self, model: nn.Module, mapping: dict[str, Callable[..., Any]]) -> None:
        self.model = model
        self.mapping = mapping

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self.mapping.get(self.model.loss_type) or self.mapping[FALLBACK_LOSS_TYPE]
        return loss(*args, **kwargs)


def pin_fallback_losses(model: nn.Module) -> list[str]:
    """Give each outermost transformers model in `model` whose loss_function would fall back (see
    above) a FallbackLoss; returns their names ("" for the root). Nothing where transformers is not
    loaded, or its LOSS_MAPPING has no ForCausalLM."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:  # no transformers model can exist
        return []
    base = modeling_utils.PreTrainedModel
    mapping = getattr(sys.modules.get("transformers.loss.loss_utils"), "LOSS_MAPPING", {})
    if FALLBACK_LOSS_TYPE not in mapping:  # a transformers whose fallback this is not: leave it be
        return []
    pinned = [name for name, module in outermost_of_class(model, base) if _falls_back(module, base)]
    for name in pinned:
        module = model.get_submodule(name)
        module._loss_function = FallbackLoss(module, mapping)
    if pinned:
        log.info(
            "zpp_compile: %s: loss_type=None; its loss_function is pinned to the loss transformers falls "
            "back to (%s), whose warning is a graph break under torch.compile",
            ", ".join(n or type(model).__name__ for n in pinned),
            FALLBACK_LOSS_TYPE,
        )
    return pinned


class InstanceMethod:
    """`function(extra, module, *args, **kwargs)` set as a method of one module instance, where
    shard() adapts a transformers model's method (save_pretrained, generate). An object, not a
    closure or a bound partial: a model holding it still pickles, and a deep copy of the model (an
    EMA, a reference model) gets one bound to the copy, not to the original."""

    def __init__(self, function: Callable[..., Any], module: nn.Module, extra: Any = None, doc: Any = None) -> None:
        self.function, self.module, self.extra = function, module, extra
        self.__doc__ = doc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.extra, self.module, *args, **kwargs)


def outermost_transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each transformers model in `model` not inside another ("" for the root);
    none where transformers is not loaded (no transformers model can exist)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return [] if modeling_utils is None else list(outermost_of_class(model, modeling_utils.PreTrainedModel))


def outermost_of_class(module: nn.Module, base: type, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The modules of class `base` in `module` (itself included) not inside another: for
    transformers models, those whose forward computes the loss (GPT2LMHeadModel, not the GPT2Model
    it holds)."""
    if isinstance(module, base):
        yield prefix, module
        return
    for name, child in module.named_children():
        yield from outermost_of_class(child, base, f"{prefix}.{name}" if prefix else name)


def _falls_back(module: nn.Module, base: type) -> bool:
    """transformers' own loss_function property (not one the class overrides), no loss function set
    (the property returns that without warning), and a loss_type None."""
    own_property = getattr(type(module), "loss_function", None) is base.loss_function
    settable = inspect.getattr_static(type(module), "_loss_function", None) is None
    unset = "_loss_function" not in module.__dict__
    return own_property and settable and unset and getattr(module, "loss_type", FALLBACK_LOSS_TYPE) is None
