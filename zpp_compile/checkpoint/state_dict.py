"""Model state dicts: the hooks shard() installs, and loading a value into a shard.

shard() installs state-dict hooks on every module that owns a shard:
  * `module.state_dict()` gives FlatShardedTensors for the sharded parameters (buffers stay plain);
  * `module.load_state_dict(sd)` takes FlatShardedTensors of the same layout (what state_dict()
    gave, possibly filled by DCP) or plain full tensors (an unsharded state dict, e.g. an export):
    each rank copies its own slice into its shard, in place.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from ..codegen.quantize import dequantize_packed, quantize_packed
from ..sharding import ShardSpec, shard_spec, state_of_shard
from .flat_sharded_tensor import FlatShardedTensor, local_range


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model or optimizer it is loaded into (keys, shapes, groups)."""


def install_state_dict_hooks(model: nn.Module) -> None:
    """Make state_dict() / load_state_dict() of every module owning a shard speak the sharded form."""
    for module in model.modules():
        if _sharded_params(module):
            module.register_state_dict_post_hook(_state_dict_post_hook)
            # The shards are filled by the pre-hook, in place, and their keys taken out of the dict,
            # so that nn.Module's own loading (which would compare them with the flat shard's shape)
            # skips them; the post-hook takes them off missing_keys again. A closure, not a module
            # attribute, carries them from one to the other, so a load sets no module attributes.
            loaded: list[str] = []
            module.register_load_state_dict_pre_hook(functools.partial(_load_state_dict_pre_hook, loaded=loaded))
            module.register_load_state_dict_post_hook(functools.partial(_load_state_dict_post_hook, loaded=loaded))


def _sharded_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None and shard_spec(p) is not None]


def _rank_of(param: Tensor) -> int:
    return state_of_shard(param).topology.rank


@torch.no_grad()
def sharded_entry(param: Tensor) -> FlatShardedTensor:
    """The state-dict value of a shard: a view of it, or for an int8-stored frozen weight its
    dequantized values (a new tensor, in the parameter's original dtype)."""
    spec = shard_spec(param)
    start, stop = local_range(spec, _rank_of(param))
    if spec.quantized_block is not None:
        values = dequantize_packed(param.detach(), 1, spec.shard_numel, spec.quantized_block, spec.dtype)
        local = values[: stop - start].clone()
    else:
        local = param.detach()[: stop - start]
    return FlatShardedTensor(local, spec.shape, start)


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in _sharded_params(module):
        if prefix + name in state_dict:
            state_dict[prefix + name] = sharded_entry(param)


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
        if key in state_dict:
            value = state_dict.pop(key)
            loaded.append(key)
            try:
                load_into_shard(param, value, key)
            except CheckpointMismatchError as err:
                error_msgs.append(str(err))


def _load_state_dict_post_hook(module: nn.Module, incompatible_keys: Any, *, loaded: list[str]) -> None:
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
    loaded.clear()


def _local_values(value: Any, spec: ShardSpec, start: int, stop: int, key: str) -> Tensor:
    """This rank's elements [start, stop) out of a FlatShardedTensor or a full tensor for `key`."""
    if not isinstance(value, Tensor):
        raise CheckpointMismatchError(f"{key}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != spec.shape:
        raise CheckpointMismatchError(
            f"size mismatch for {key}: the checkpoint has shape {tuple(value.shape)}, "
            f"the model {spec.shape}"
        )
    if isinstance(value, FlatShardedTensor):
        if (value.start, value.stop) != (start, stop):
            raise CheckpointMismatchError(
                f"{key}: this FlatShardedTensor holds elements [{value.start}, {value.stop}) but this rank's "
                f"shard holds [{start}, {stop}): it was made for another world size; load the checkpoint "
                "through torch.distributed.checkpoint (zpp_compile.load_checkpoint), which reshards"
            )
        return value.local
    return value.detach().reshape(-1)[start:stop]


@torch.no_grad()
def _write_local(target: Tensor, local: Tensor) -> None:
    """Fill a shard-shaped tensor with this rank's values and zero its padding."""
    n = local.numel()
    if n and local.data_ptr() == target.data_ptr() and local.dtype == target.dtype:
        return  # already in place: DCP loaded straight into the shard
    target[:n].copy_(local)
    target[n:].zero_()


@torch.no_grad()
def _write_quantized(payload: Tensor, local: Tensor, spec: ShardSpec) -> None:
    """An int8-stored frozen weight: quantize this rank's values (zero-padded) into its payload."""
    padded = torch.zeros(spec.shard_numel, dtype=spec.dtype, device=payload.device)
    padded[: local.numel()].copy_(local)
    payload.copy_(quantize_packed(padded, spec.quantized_block))


def load_into_shard(param: Tensor, value: Any, key: str) -> None:
    """Copy this rank's slice of `value` (a FlatShardedTensor of this layout, or the full tensor)
    into the shard `param`, in place."""
    spec = shard_spec(param)
    start, stop = local_range(spec, _rank_of(param))
    local = _local_values(value, spec, start, stop, key)
    if spec.quantized_block is not None:
        _write_quantized(param.detach(), local, spec)
    else:
        _write_local(param.detach(), local)
