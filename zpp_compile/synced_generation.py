"""transformers' `generate()` on a sharded model keeps every rank stepping until all are done.

Each step of `generate()` runs the model's forward, whose weight gathers are collectives. A rank
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


def install_synced_generation(model: nn.Module, world_size: int) -> None:
    """Default `synced_gpus=True` in the generate() of each outermost transformers model in
    `model` (the root included; a PEFT model's generate calls its inner model's)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None or world_size == 1:
        return
    for _, inner in outermost_of_class(model, modeling_utils.PreTrainedModel):
        if callable(getattr(inner, "generate", None)):
            inner.generate = _synced(inner.generate)


def _synced(generate: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def synced_generate(*args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in signature.bind_partial(*args, **kwargs).arguments:
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    return synced_generate
