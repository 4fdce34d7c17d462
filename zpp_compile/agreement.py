"""shard() makes every rank agree on what it shards before anything is split.

Ranks whose Config or model differ would pair collectives of different sizes: gloo aborts one
rank ("Received data size doesn't match", SIGABRT) and the others report a dead peer; with equal
sizes the ranks would silently mix tensors. shard() therefore compares a fingerprint of the Config
and of every parameter (name, shape, dtype, requires_grad) across ranks, and raises ShardingError
on every rank, naming the first difference, before any shard is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from .config import Config
from .layout import ShardingError

# Config fields that may differ between ranks without changing what they communicate.
_RANK_LOCAL_FIELDS = ("dump_graphs_dir",)


def config_fingerprint(config: Config) -> list[tuple[str, str]]:
    return [
        (f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config) if f.name not in _RANK_LOCAL_FIELDS
    ]


def parameter_fingerprint(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]


def agree_on_model(model: nn.Module, config: Config) -> None:
    """Raise ShardingError on every rank unless all ranks shard the same model with the same Config
    (collective: one all-gather of a digest; the details travel only when they differ)."""
    mine = {"config": config_fingerprint(config), "parameters": parameter_fingerprint(model)}
    if all_equal(digest(mine)):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    raise ShardingError(describe_disagreement(everyone))


def digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def all_equal(digest: str) -> bool:
    digests: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return len(set(digests)) == 1


def describe_disagreement(everyone: list[dict]) -> str:
    """The first difference between rank 0's fingerprint and another rank's, in words."""
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for what in ("config", "parameters"):
            difference = _first_difference(reference[what], theirs[what], what, rank)
            if difference:
                return (
                    f"zpp_compile.shard(): ranks disagree on what they shard: {difference}. Every rank "
                    "must call shard() with the same Config on the same model (same parameter names, "
                    "shapes, dtypes and requires_grad); build the model and Config identically on "
                    "every rank (seed, arguments, checkpoint) before sharding."
                )
    return "zpp_compile.shard(): ranks disagree on what they shard (no single difference found)"


def _first_difference(ours: list, theirs: list, what: str, rank: int) -> Optional[str]:
    for a, b in zip(ours, theirs):
        if a != b:
            if what == "config":
                return f"Config.{a[0]} is {a[1]} on rank 0 but {b[1]} on rank {rank}"
            return f"parameter {_describe(a)} on rank 0 but {_describe(b)} on rank {rank}"
    if len(ours) != len(theirs):
        longer, who = (ours, 0) if len(ours) > len(theirs) else (theirs, rank)
        extra = longer[min(len(ours), len(theirs))]
        return (
            f"rank 0 has {len(ours)} parameters, rank {rank} {len(theirs)}; the first one only rank {who} "
            f"has is {_describe(extra)}"
        )
    return None


def _describe(entry: tuple) -> str:
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", frozen"
    return f"{name!r} (shape {shape}, {dtype.removeprefix('torch.')}{frozen})"
