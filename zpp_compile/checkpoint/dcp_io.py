"""Whole checkpoints through torch.distributed.checkpoint: save_checkpoint and load_checkpoint.

A checkpoint holds the model's state dict under MODEL_KEY, the optimizer's under OPTIM_KEY and
the caller's `extra` dict under EXTRA_KEY.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torch.distributed.checkpoint.state_dict import _init_optim_state

from ..layout import sharded_state, unwrap_compiled
from .optimizer import load_optimizer_state_dict, optimizer_state_dict
from .state_dict import CheckpointMismatchError

PathLike = Union[str, os.PathLike]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    extra: Optional[dict[str, Any]] = None,
) -> None:
    """Save the sharded model (and optimizer, and `extra`) as a DCP checkpoint in the folder `path`.

    Collective: every rank calls it with the same path (a folder every rank can write to). Each
    rank writes its own elements; nothing is gathered. `extra` holds values equal on every rank
    (a step counter, a data-loader position): DCP writes one copy of each.
    """
    model = unwrap_compiled(model)
    sharded_state(model)
    state: dict[str, Any] = {MODEL_KEY: model.state_dict()}
    if optim is not None:
        state[OPTIM_KEY] = optimizer_state_dict(model, optim)
    if extra is not None:
        state[EXTRA_KEY] = extra
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint of save_checkpoint() into the sharded `model` (and `optim`), in place, at
    any world size; returns the checkpoint's `extra` dict ({} if it has none).

    Collective. Checks the checkpoint against the model first and raises CheckpointMismatchError
    naming every differently shaped key and, with `strict`, every missing or unexpected one
    (without `strict`, entries the checkpoint lacks keep their values). `optim` may be freshly
    built (no state yet).
    """
    model = unwrap_compiled(model)
    sharded_state(model)
    metadata = dcp.FileSystemReader(path).read_metadata()
    paths: dict[str, tuple] = metadata.planner_data
    if not paths:
        raise CheckpointMismatchError(f"{os.fspath(path)!r} is not a checkpoint of zpp_compile.save_checkpoint")

    model_sd = model.state_dict()
    _check_model_keys(model_sd, metadata, paths, strict, path)
    if not strict:  # entries the checkpoint lacks keep their values
        saved = _keys_under(paths, MODEL_KEY)
        model_sd = {k: v for k, v in model_sd.items() if k in saved}
    state: dict[str, Any] = {MODEL_KEY: model_sd}
    if optim is not None:
        state[OPTIM_KEY] = _optimizer_load_target(model, optim, paths, path)
    extra = _plain_load_target(metadata, paths, EXTRA_KEY)
    if extra:
        state[EXTRA_KEY] = extra[EXTRA_KEY]

    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state[MODEL_KEY], strict=strict)
    if optim is not None:
        load_optimizer_state_dict(model, optim, state[OPTIM_KEY])
    return state.get(EXTRA_KEY, {})


def _keys_under(paths: dict[str, tuple], top: str) -> dict[str, str]:
    """{name below `top`: flat DCP key} for a top-level entry saved as a flat dict (the model's)."""
    return {".".join(map(str, p[1:])): flat for flat, p in paths.items() if p[0] == top}


def _check_model_keys(model_sd: dict, metadata: Metadata, paths: dict, strict: bool, where: PathLike) -> None:
    saved = _keys_under(paths, MODEL_KEY)
    problems = []
    missing = [k for k in model_sd if k not in saved]
    if missing and strict:
        problems.append(f"missing key(s) in the checkpoint: {missing}")
    unexpected = [k for k in saved if k not in model_sd]
    if unexpected and strict:
        problems.append(f"unexpected key(s) in the checkpoint (the model has no such entry): {unexpected}")
    for key, value in model_sd.items():
        md = metadata.state_dict_metadata.get(saved.get(key, ""))
        if isinstance(md, TensorStorageMetadata) and isinstance(value, Tensor) and md.size != value.shape:
            problems.append(
                f"size mismatch for {key}: the checkpoint has shape {tuple(md.size)}, the model {tuple(value.shape)}"
            )
    if problems:
        lines = "\n  ".join(problems)
        raise CheckpointMismatchError(f"checkpoint {os.fspath(where)!r} does not fit the model:\n  {lines}")


def _plain_load_target(metadata: Metadata, paths: dict, top: str) -> dict:
    """A structure for DCP to load entries under `top` into: new tensors, None for other objects."""
    target: dict = {}
    for flat, path in paths.items():
        if path[0] == top:
            _set_path(target, path, _fresh_value(metadata.state_dict_metadata[flat]))
    return target


def _set_path(root: dict, path: tuple, value: Any) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way:
    the nesting DCP flattened the saved state dict from (metadata.planner_data)."""
    node: Any = root
    for key, following in zip(path[:-1], path[1:]):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            node = node.setdefault(key, fresh)
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _fresh_value(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None  # a pickled object: DCP replaces the placeholder


def _optimizer_load_target(model: nn.Module, optim: torch.optim.Optimizer, paths: dict, where: PathLike) -> dict:
    """The optimizer's own state entries (made by a zero-lr step if it has none yet), for DCP to
    load into in place: DTensor entries get this rank's chunks, resharded from any world size."""
    if not any(p[0] == OPTIM_KEY for p in paths.values()):
        raise CheckpointMismatchError(f"checkpoint {os.fspath(where)!r} holds no optimizer state")
    _init_optim_state(optim)
    return optimizer_state_dict(model, optim)
