"""What shard() settles on a Hugging Face transformers model so that torch.compile traces it once.

transformers' `PreTrainedModel.loss_function` property looks the model's `loss_type` up in its
LOSS_MAPPING. A model whose class name names no loss there (`GPT2LMHeadModel`, ...) has
`loss_type = None`, and the property then logs a warning and falls back to "ForCausalLM" on every
call. Under torch.compile that logging call is a graph break at the end of the forward, inside
the loss, below three frames (the output wrapper, the deprecation wrapper, the model's forward):
Dynamo traces the whole model once per frame only to give that frame up, then a fourth time to
compile it. For a sharded model each trace costs more than for a plain one (every parameter read
is traced, see sharding.py), so this cost grows with the model.

shard() names the fallback itself: `loss_type = "ForCausalLM"` where it is None. The property then
returns the loss it would have fallen back to, without the logging call: the same loss, no break.
A loss_type the user set, even an unknown one, is left alone (transformers' warning about it is
the user's to see).
"""

from __future__ import annotations

import logging
import sys
from typing import Iterator

from torch import nn

log = logging.getLogger(__name__)

FALLBACK_LOSS_TYPE = "ForCausalLM"  # what PreTrainedModel.loss_function falls back to for None


def name_fallback_loss_types(model: nn.Module) -> list[str]:
    """Set loss_type to transformers' fallback on each module of `model` that would fall back
    (see above); returns their names ("" for the root). Nothing where transformers is not loaded."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:  # no transformers model can exist
        return []
    base = modeling_utils.PreTrainedModel
    mapping = getattr(sys.modules.get("transformers.loss.loss_utils"), "LOSS_MAPPING", {})
    if FALLBACK_LOSS_TYPE not in mapping:  # a transformers whose fallback this is not: leave it be
        return []
    named = [name for name, module in _outermost(model, base) if _falls_back(module, base)]
    for name in named:
        model.get_submodule(name).loss_type = FALLBACK_LOSS_TYPE
    if named:
        log.info(
            "zpp_compile: %s: loss_type=None set to %r, the loss transformers falls back to (its fallback "
            "logs a warning, a graph break under torch.compile)",
            ", ".join(n or type(model).__name__ for n in named),
            FALLBACK_LOSS_TYPE,
        )
    return named


def _outermost(module: nn.Module, base: type, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The transformers models in `module` not inside another: those whose forward computes the
    loss (GPT2LMHeadModel, not the GPT2Model it holds)."""
    if isinstance(module, base):
        yield prefix, module
        return
    for name, child in module.named_children():
        yield from _outermost(child, base, f"{prefix}.{name}" if prefix else name)


def _falls_back(module: nn.Module, base: type) -> bool:
    """loss_type None under transformers' own loss_function property (not one the class overrides)."""
    own_property = getattr(type(module), "loss_function", None) is base.loss_function
    return own_property and getattr(module, "loss_type", FALLBACK_LOSS_TYPE) is None
