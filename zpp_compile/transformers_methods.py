"""Methods of transformers models that shard() adapts to a sharded model.

`generate()` keeps every rank stepping until all are done. Each step of `generate()` runs the
model's forward, whose weight gathers are collectives. A rank whose sequences all end early (EOS)
leaves its loop while the others wait in their next gather, until `collective_timeout_s` (or
torch's process-group timeout, 30 minutes, without it): ranks that evaluate different prompts end
at different steps. transformers has the remedy built in: `synced_gpus=True` keeps a finished rank
running the forward, its output discarded, until every rank has finished (one all-reduce of a
flag per step). It turns that on by itself for DeepSpeed ZeRO-3 and FSDP modules, not for ours,
so on a sharded model of more than one rank generate() always runs with it: also where the
caller passes `synced_gpus=False` (Seq2SeqTrainer passes it for any model that is neither), since
without it ranks can only stay together by luck, and with it the tokens are the same.

`resize_token_embeddings` to another size is refused with the order to call it in: it builds a
new embedding from the old one's values, which DTensor cannot do for it (torch's error names an
operator, not the cause), and the new weight would be unsharded. A call that keeps the size
(`model.resize_token_embeddings(len(tokenizer))`, which scripts make unconditionally) runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .hugging_face import InstanceMethod, outermost_transformers_models
from .layout import ShardingError


def adapt_transformers_methods(model: nn.Module, world_size: int) -> None:
    """In each outermost transformers model in `model` (the root included; a PEFT model calls its
    inner model's): generate() with synced_gpus=True (more than one rank), and
    resize_token_embeddings() refused where it changes the size."""
    for _, inner in outermost_transformers_models(model):
        generate = getattr(type(inner), "generate", None)
        if callable(generate) and world_size > 1:
            inner.generate = InstanceMethod(_synced_generate, inner, doc=generate.__doc__)
        resize = getattr(type(inner), "resize_token_embeddings", None)
        if callable(resize):
            inner.resize_token_embeddings = InstanceMethod(_resize_keeping_the_size, inner, doc=resize.__doc__)


def _synced_generate(_: None, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).generate
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.arguments["synced_gpus"] = True
    return original(*bound.args, **bound.kwargs)


def _resize_keeping_the_size(_: None, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).resize_token_embeddings
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    rows = self.get_input_embeddings().weight.shape[0]
    wanted = bound.arguments.get("new_num_tokens") or rows
    multiple = bound.arguments.get("pad_to_multiple_of")
    if multiple:
        wanted = -(-wanted // multiple) * multiple  # transformers rounds up to the multiple
    if wanted != rows:
        raise ShardingError(
            f"resize_token_embeddings to {wanted} rows on a model zpp_compile.shard() has sharded "
            f"({rows} rows now): the new embedding would be built from the sharded one and stay "
            "unsharded. Resize before sharding: model.resize_token_embeddings(n), then "
            "zpp_compile.shard(model, config)."
        )
    return original(*bound.args, **bound.kwargs)
