"""Methods of transformers models that shard() adapts to a sharded model.

`resize_token_embeddings` is refused with the order to call it in: it builds a new embedding from
the old one's values, which DTensor cannot do for it (torch's error names an operator, not the
cause), and the new weight would be unsharded.

`generate()` keeps every rank stepping until all are done. Each step of `generate()` runs the model's forward, whose weight gathers are collectives. A rank
whose sequences all end early (EOS) leaves its loop while the others wait in their next gather,
until `collective_timeout_s` (or torch's process-group timeout, 30 minutes, without it): ranks
that evaluate different prompts end at different steps. transformers has the remedy built in:
`synced_gpus=True` keeps a finished rank running the forward, its output discarded, until every
rank has finished (one all-reduce of a flag per step). It turns that on by itself for DeepSpeed
ZeRO-3 and FSDP modules, not for ours, so shard() makes it the default of each transformers model
in a sharded model of more than one rank. A `synced_gpus` the caller passes is kept.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

from torch import nn

from .hugging_face import outermost_of_class
from .layout import ShardingError


def adapt_transformers_methods(model: nn.Module, world_size: int) -> None:
    """In each outermost transformers model in `model` (the root included; a PEFT model calls its
    inner model's): generate() defaults to synced_gpus=True (more than one rank), and
    resize_token_embeddings() is refused."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return
    for _, inner in outermost_of_class(model, modeling_utils.PreTrainedModel):
        if callable(getattr(inner, "generate", None)) and world_size > 1:
            inner.generate = _synced(inner.generate)
        if callable(getattr(inner, "resize_token_embeddings", None)):
            inner.resize_token_embeddings = _refusing_resizes(inner, inner.resize_token_embeddings)


def _refusing_resizes(model: nn.Module, resize: Callable[..., Any]) -> Callable[..., Any]:
    """resize_token_embeddings that still runs where it changes nothing (no size, or the current
    one: scripts call `model.resize_token_embeddings(len(tokenizer))` unconditionally)."""

    @functools.wraps(resize)
    def resize_token_embeddings(new_num_tokens: Any = None, pad_to_multiple_of: Any = None, **kwargs: Any) -> Any:
        rows = model.get_input_embeddings().weight.shape[0]
        if new_num_tokens is not None and (new_num_tokens != rows or pad_to_multiple_of is not None):
            raise ShardingError(
                f"resize_token_embeddings({new_num_tokens}) on a model zpp_compile.shard() has sharded "
                f"({rows} rows now): the new embedding would be built from the sharded one and stay "
                "unsharded. Resize before sharding: model.resize_token_embeddings(n), then "
                "zpp_compile.shard(model, config)."
            )
        return resize(new_num_tokens, pad_to_multiple_of, **kwargs)

    return resize_token_embeddings


def _synced(generate: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def synced_generate(*args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in signature.bind_partial(*args, **kwargs).arguments:
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    return synced_generate
