"""The state-dict hooks shard() installs, and a parameter's values as state dicts hold them.

Sharded parameters are DTensors, which torch's state-dict and checkpoint code (state_dict(),
get_state_dict, DCP) already treats as distributed tensors: state_dict() returns them unchanged.
The hooks cover what DTensor alone does not:
  * load_state_dict() with plain full tensors (an unsharded state dict, an export): each rank takes
    its chunk, then nn.Module's own loading copies DTensor into DTensor;
  * frozen weights stored int8 (Config.quantize_frozen_weights): the parameter holds no values,
    so state_dict() gives its dequantized chunk as a DTensor, and loading quantizes into the payload;
  * DTensors read back from another rank's torch.save are refused (check_own_chunk). torch.save
    pickles each DTensor as the saving process's chunk with its mesh, which remembers that
    process's coordinate and the world size. nanoGPT's pattern, saving on rank 0 and loading on
    every rank, would hand every rank rank 0's chunks, and DTensor copies chunk into chunk: training
    would go on from other rows' values without an error. Per-rank files read back by the rank
    that wrote them, at the same world size, pass. (Optimizer state: optimizer.py.)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..codegen.quantize import dequantize_packed, quantize_packed
from ..dtensor_ops import chunk_of, is_replicated
from ..layout import ShardSpec, int8_payload, shard_spec, state_of_shard


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model or optimizer it is loaded into (keys, shapes, types)."""


FULL_SAVE_HINT = (
    "torch.save(model.state_dict()) or torch.save(optimizer.state_dict()) on one rank writes only that "
    "rank's chunks. Save a checkpoint every rank can load: zpp_compile.save_checkpoint(path, model, "
    "optimizer) on every rank (it loads at any world size), or full tensors: on every rank "
    "get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) "
    "from torch.distributed.checkpoint.state_dict (zpp_compile.full_state_dict(model, rank0_only=True) "
    "for the model alone), then torch.save on rank 0"
)


def check_own_chunk(value: DTensor, like: DTensor, what: str) -> None:
    """Raise CheckpointMismatchError unless `value` holds this rank's chunk in `like`'s layout.
    Replicated on both sides, every rank's values are the same: only the world size must match."""
    saved, here = value.device_mesh, like.device_mesh
    if saved is here:
        return
    replicated = is_replicated(value) and is_replicated(like)
    if saved.size() != here.size():
        raise CheckpointMismatchError(
            f"{what} is a chunk saved at world size {saved.size()}, loaded at world size {here.size()}. "
            + FULL_SAVE_HINT
        )
    if not replicated and saved.get_coordinate() != here.get_coordinate():
        raise CheckpointMismatchError(
            f"{what} holds the chunk of rank {_mesh_rank(saved)} of the job that saved it, loaded on rank "
            f"{_mesh_rank(here)}: it would train from another rank's values. " + FULL_SAVE_HINT
        )


def _mesh_rank(mesh: Any) -> str:
    coordinate = mesh.get_coordinate()
    return str(coordinate[0]) if coordinate is not None and len(coordinate) == 1 else str(coordinate)


def install_state_dict_hooks(model: nn.Module) -> None:
    """Make load_state_dict() of every module owning a sharded parameter take full tensors, and
    state_dict() / load_state_dict() read and write int8-stored frozen weights."""
    for module in model.modules():
        if not _sharded_params(module):
            continue
        module.register_state_dict_post_hook(_state_dict_post_hook)
        # Int8-stored entries are written by the pre-hook and taken out of the dict, so that
        # nn.Module's own loading skips them; the post-hook takes them off missing_keys again.
        loaded: list[str] = []
        module.register_load_state_dict_pre_hook(functools.partial(_load_state_dict_pre_hook, loaded=loaded))
        module.register_load_state_dict_post_hook(functools.partial(_load_state_dict_post_hook, loaded=loaded))


def _sharded_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None and shard_spec(p) is not None]


@torch.no_grad()
def stored_values(module: nn.Module, name: str, param: DTensor) -> DTensor:
    """The parameter as a state dict holds it: itself, or for an int8-stored frozen weight a
    DTensor of its dequantized chunk (a new tensor, in the parameter's dtype)."""
    payload = int8_payload(module, name)
    if payload is None:
        return param
    spec = shard_spec(param)
    values = dequantize_packed(payload, 1, spec.shard_numel, spec.quantized_block, spec.dtype)
    local = values[: spec.local_numel(_rank_of(param))].view(param.to_local().shape).clone()
    return _like(param, local)


@torch.no_grad()
def full_value(module: nn.Module, name: str, param: DTensor) -> Tensor:
    """The unsharded values of `module.<name>` (collective): the master values, not param_dtype."""
    return stored_values(module, name, param).full_tensor().clone()


def _like(param: DTensor, local: Tensor) -> DTensor:
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


def _rank_of(param: Tensor) -> int:
    return state_of_shard(param).topology.rank


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in _sharded_params(module):
        if prefix + name in state_dict and int8_payload(module, name) is not None:
            state_dict[prefix + name] = stored_values(module, name, param)


def _load_state_dict_pre_hook(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
    *,
    loaded: list[str],
) -> None:
    loaded.clear()
    for name, param in _sharded_params(module):
        key = prefix + name
        if key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, DTensor) and value.device_mesh is not param.device_mesh:
            if is_replicated(value):  # read from a file: the whole tensor, as any full tensor loads
                state_dict[key] = value.to_local()
            else:  # raised, not collected: one message, not one per parameter
                check_own_chunk(value, param, key)
        try:
            if int8_payload(module, name) is not None:
                _load_into_payload(module, name, param, state_dict.pop(key), key)
                loaded.append(key)
            else:
                state_dict[key] = as_sharded_like(param, state_dict[key], key)
        except CheckpointMismatchError as err:
            error_msgs.append(str(err))


def _load_state_dict_post_hook(module: nn.Module, incompatible_keys: Any, *, loaded: list[str]) -> None:
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
    loaded.clear()


def as_sharded_like(param: DTensor, value: Any, key: str) -> Any:
    """A full plain tensor for `param` as a DTensor of this rank's chunk (no communication);
    DTensors and tensors of another shape pass through (nn.Module reports the shape mismatch)."""
    if not isinstance(value, Tensor) or isinstance(value, DTensor) or value.shape != param.shape:
        return value
    return _like(param, chunk_of(value.detach(), param).to(param.dtype))


def _local_values(param: DTensor, value: Any, key: str) -> Tensor:
    """This rank's chunk out of a DTensor or a full tensor for `key`."""
    if not isinstance(value, Tensor):
        raise CheckpointMismatchError(f"{key}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointMismatchError(
            f"size mismatch for {key}: the checkpoint has shape {tuple(value.shape)}, the model {tuple(param.shape)}"
        )
    if isinstance(value, DTensor):
        check_own_chunk(value, param, key)
        return value.redistribute(param.device_mesh, param.placements).to_local()
    return chunk_of(value.detach(), param)


@torch.no_grad()
def _load_into_payload(module: nn.Module, name: str, param: DTensor, value: Any, key: str) -> None:
    """An int8-stored frozen weight: quantize this rank's values (zero-padded) into its payload."""
    spec: ShardSpec = shard_spec(param)
    local = _local_values(param, value, key).reshape(-1)
    padded = torch.zeros(spec.shard_numel, dtype=spec.dtype, device=local.device)
    padded[: local.numel()].copy_(local)
    int8_payload(module, name).copy_(quantize_packed(padded, spec.quantized_block))
