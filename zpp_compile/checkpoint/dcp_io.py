"""Whole checkpoints through torch.distributed.checkpoint: save_checkpoint and load_checkpoint.

A checkpoint holds the model's state dict under MODEL_KEY, the optimizer's under OPTIM_KEY, each
rank's generator states under RNG_KEY and the caller's `extra` dict under EXTRA_KEY, written
atomically with a completion marker (folders.py), optionally with checksums (checksums.py).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state

from ..error_feedback import error_state, restore_error_state
from ..grad_sync import refuse_pending
from ..layout import sharded_state, unwrap_compiled
from .checksums import gather_checksums, verify_checksums, with_unclaimed_files
from .folders import Marker, PathLike, SaveFolders, read_metadata, require_complete
from .optimizer import check_hyper_parameter_keys, load_optimizer_state_dict, optimizer_class_name, optimizer_state_dict
from .per_rank import as_rows, own_rows, rows_load_target
from .ranks import on_rank0
from .rng import RNG_KEY, restore_rng_states, rng_load_target, rng_states
from .state_dict import CheckpointMismatchError

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"
QGZ_ERROR_KEY = "qgz_error"  # this model's qgZ error-feedback state, rows per rank (per_rank.py)


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    extra: Optional[dict[str, Any]] = None,
    *,
    checksums: bool = False,
) -> None:
    """Save the sharded model (and optimizer, each rank's RNG states, and `extra`) as a DCP
    checkpoint in the folder `path`, atomically: a save killed part-way leaves a previous `path`
    as it was.

    Collective: every rank calls it with the same arguments and path (on a file system every
    rank can write to and rename in). Each rank writes its own elements; no parameter is
    gathered. `extra` holds values equal on every rank (a step counter, a data-loader position):
    DCP writes one copy of each. With `checksums`, the sha256 of every data file is recorded, and
    load_checkpoint verifies it. `path` must not exist, or be a checkpoint folder (it is replaced);
    anything else there is refused with FileExistsError. Refused (PendingGradientsError) while
    gradients accumulated under no_sync wait for their reduction: save after the optimizer step.
    """
    model = unwrap_compiled(model)
    # Gradients accumulated under no_sync are not part of a checkpoint: refuse rather than drop them.
    refuse_pending(model, "save_checkpoint")
    state = _state_to_save(model, optim, extra)  # the RNG states as they are at the call
    folders = on_rank0(lambda: SaveFolders.new(path))
    dcp.save(state, checkpoint_id=folders.staging)
    digests = gather_checksums(folders.staging, hash_files=checksums)  # also the barrier: all files written
    on_rank0(lambda: folders.publish(_marker(folders, optim, digests if checksums else None)))


def _state_to_save(model: nn.Module, optim: Optional[torch.optim.Optimizer], extra: Optional[dict]) -> dict[str, Any]:
    sharded = sharded_state(model)
    state: dict[str, Any] = {MODEL_KEY: model.state_dict(), RNG_KEY: rng_states(sharded.mesh)}
    errors = {key: as_rows(t, sharded.mesh) for key, t in error_state(sharded.plan_id).items()}
    if errors:
        state[QGZ_ERROR_KEY] = errors
    if optim is not None:
        state[OPTIM_KEY] = optimizer_state_dict(model, optim)
    if extra is not None:
        state[EXTRA_KEY] = extra
    return state


def _marker(folders: SaveFolders, optim: Optional[torch.optim.Optimizer], digests: Optional[dict]) -> Marker:
    if digests is not None:
        digests = with_unclaimed_files(folders.staging, digests)
    optimizer = None if optim is None else optimizer_class_name(optim)
    return Marker.new(dist.get_world_size(), optimizer, digests)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
    verify: Optional[bool] = None,
) -> dict[str, Any]:
    """Load a checkpoint of save_checkpoint() into the sharded `model` (and `optim`), in place, at
    any world size; returns the checkpoint's `extra` dict ({} if it has none).

    Collective. Refuses (CheckpointMismatchError) a folder whose save did not finish, then, before
    reading anything: with `verify` (default: when the checkpoint has checksums) data files whose
    sha256 differs from the recorded one; keys of another shape and, with `strict`, missing or
    unexpected keys (without `strict`, entries the checkpoint lacks keep their values); optimizer
    state of another optimizer class. `optim` may be freshly built (no state yet). Each rank's
    RNG states are restored when the world size is the one saved at (else a warning).
    """
    model = unwrap_compiled(model)
    marker = require_complete(path)
    if _should_verify(marker, verify, path):
        verify_checksums(path, marker.checksums)
    state = _checked_load_targets(path, model, optim, marker, strict)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state[MODEL_KEY], strict=strict)
    if optim is not None:
        load_optimizer_state_dict(model, optim, state[OPTIM_KEY])
    restore_rng_states(state.get(RNG_KEY, {}))
    errors = own_rows(state.get(QGZ_ERROR_KEY, {}))
    restore_error_state(sharded_state(model).plan_id, errors)
    return state.get(EXTRA_KEY, {})


def _checked_load_targets(
    path: PathLike, model: nn.Module, optim: Optional[torch.optim.Optimizer], marker: Optional[Marker], strict: bool
) -> dict[str, Any]:
    """What dcp.load reads into, {top-level key: state}, after checking from the metadata alone
    that the checkpoint fits the model and optimizer."""
    mesh = sharded_state(model).mesh
    metadata = read_metadata(path)
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
        state[OPTIM_KEY] = _optimizer_load_target(model, optim, paths, marker, path)
    extra = _plain_load_target(metadata, paths, EXTRA_KEY)
    if extra:
        state[EXTRA_KEY] = extra[EXTRA_KEY]
    rng = rng_load_target(_saved_sizes(metadata, paths, RNG_KEY), mesh, os.fspath(path))
    if rng:
        state[RNG_KEY] = rng
    errors = rows_load_target(
        _saved_sizes(metadata, paths, QGZ_ERROR_KEY), mesh, "qgZ error-feedback state", os.fspath(path)
    )
    if errors:
        state[QGZ_ERROR_KEY] = errors
    return state


def _should_verify(marker: Optional[Marker], verify: Optional[bool], where: PathLike) -> bool:
    has_checksums = marker is not None and marker.checksums is not None
    if verify and not has_checksums:
        raise CheckpointMismatchError(
            f"load_checkpoint({os.fspath(where)!r}, verify=True): the checkpoint holds no checksums (it was "
            "saved without checksums=True, or by zpp_compile 0.1): load it with verify=None"
        )
    return has_checksums if verify is None else verify


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


def _saved_sizes(metadata: Metadata, paths: dict, top: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (saved shape, dtype)} of the tensors saved directly under `top`."""
    sizes = {}
    for flat, path in paths.items():
        md = metadata.state_dict_metadata[flat]
        if path[0] == top and len(path) == 2 and isinstance(md, TensorStorageMetadata):
            sizes[path[1]] = (md.size, md.properties.dtype)
    return sizes


def _optimizer_load_target(
    model: nn.Module, optim: torch.optim.Optimizer, paths: dict, marker: Optional[Marker], where: PathLike
) -> dict:
    """The optimizer's own state entries (made by a zero-lr step if it has none yet), for DCP to
    load into in place: DTensor entries get this rank's chunks, resharded from any world size."""
    if not any(p[0] == OPTIM_KEY for p in paths.values()):
        raise CheckpointMismatchError(f"checkpoint {os.fspath(where)!r} holds no optimizer state")
    _check_optimizer_class(optim, marker, paths, where)
    _init_optim_state(optim)
    return optimizer_state_dict(model, optim)


def _check_optimizer_class(
    optim: torch.optim.Optimizer, marker: Optional[Marker], paths: dict, where: PathLike
) -> None:
    """Refuse optimizer state saved from another optimizer class, by the class the marker records
    or, for a legacy checkpoint (no marker), by the param groups' hyper-parameter keys."""
    if marker is not None and marker.optimizer is not None:
        if marker.optimizer != optimizer_class_name(optim):
            raise CheckpointMismatchError(
                f"checkpoint {os.fspath(where)!r} holds the state of a {marker.optimizer} optimizer, not of a "
                f"{optimizer_class_name(optim)}: build the optimizer it was saved from, or load the model alone "
                "(load_checkpoint(path, model)) and start this optimizer fresh"
            )
        return
    check_hyper_parameter_keys(_saved_group_keys(paths), optim, f"checkpoint {os.fspath(where)!r}")


def _saved_group_keys(paths: dict) -> list[set[str]]:
    """The keys of each saved optimizer param group, from the metadata (nothing is read)."""
    groups: dict[int, set[str]] = {}
    for path in paths.values():
        if path[:2] == (OPTIM_KEY, "param_groups") and len(path) > 3:
            groups.setdefault(path[2], set()).add(path[3])
    return [groups[i] for i in sorted(groups)]
