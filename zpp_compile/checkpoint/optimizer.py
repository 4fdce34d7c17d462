"""Optimizer state dicts keyed by parameter name, sharded like the model (no communication)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from ..sharding import shard_spec, sharded_state, state_of_shard, unwrap_compiled
from .flat_sharded_tensor import FlatShardedTensor, local_range
from .state_dict import CheckpointMismatchError, _local_values, _rank_of, _write_local

SHARDED_STATE_KEY = "sharded_state"  # in an optimizer state dict: [[fqn, state key], ...] that are sharded


def _optimizer_params(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[tuple[str, Tensor]]]:
    """(fqn, shard) per parameter of each param group; refuses parameters not sharded by `model`."""
    state = sharded_state(model)
    groups = []
    for i, group in enumerate(optim.param_groups):
        named = []
        for p in group["params"]:
            spec = shard_spec(p)
            if spec is None or state_of_shard(p) is not state:
                raise ValueError(
                    f"param group {i} of the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                    "shard of this model: build the optimizer on model.parameters() after zpp_compile.shard(model)"
                )
            named.append((spec.fqn, p))
        groups.append(named)
    return groups


def optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the model (no communication).

        {"state": {fqn: {key: value}}, "param_groups": [{hyper-parameters..., "params": [fqn, ...]}],
         "sharded_state": [[fqn, key], ...]}

    A state tensor with the shard's shape (AdamW's exp_avg, exp_avg_sq) becomes a
    FlatShardedTensor of the parameter's full shape; a scalar tensor (AdamW's step) stays a plain
    tensor, assumed equal on every rank; other values are kept as they are. Tied parameters
    appear once, under the name shard() gave them (the first one).
    """
    model = unwrap_compiled(model)
    state: dict[str, dict[str, Any]] = {}
    sharded_keys: list[list[str]] = []
    groups = []
    for group, named in zip(optim.param_groups, _optimizer_params(model, optim)):
        for fqn, p in named:
            if optim.state.get(p):
                state[fqn] = {}
                for key, value in optim.state[p].items():
                    state[fqn][key] = _optimizer_entry(p, fqn, key, value, sharded_keys)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [fqn for fqn, _ in named]})
    return {"state": state, "param_groups": groups, SHARDED_STATE_KEY: sharded_keys}


def _optimizer_entry(p: Tensor, fqn: str, key: str, value: Any, sharded_keys: list) -> Any:
    if not isinstance(value, Tensor):
        return value
    spec = shard_spec(p)
    if value.shape == p.shape and spec.quantized_block is None:
        start, stop = local_range(spec, _rank_of(p))
        sharded_keys.append([fqn, key])
        return FlatShardedTensor(value.detach()[: stop - start], spec.shape, start)
    if value.numel() == 1:
        return value
    raise ValueError(
        f"optimizer state {fqn!r}[{key!r}] has shape {tuple(value.shape)}, neither the shard's "
        f"{tuple(p.shape)} nor a scalar: zpp_compile cannot checkpoint it sharded"
    )


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a state dict from optimizer_state_dict() (its FlatShardedTensors of this layout, as
    filled by DCP, or full tensors for the keys listed in "sharded_state", e.g. from an export).

    Works on a fresh optimizer (no state yet): the state tensors are created. Hyper-parameters of
    the param groups are taken from the state dict, as torch.optim.Optimizer.load_state_dict does.
    """
    model = unwrap_compiled(model)
    named_groups = _optimizer_params(model, optim)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(named_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved_groups)} optimizer param groups, the optimizer {len(named_groups)}"
        )
    params: dict[str, Tensor] = {}
    for i, (saved, named) in enumerate(zip(saved_groups, named_groups)):
        names = {fqn for fqn, _ in named}
        if set(saved["params"]) != names:  # state is keyed by name: the order may differ
            raise CheckpointMismatchError(
                f"param group {i}: parameters only in the checkpoint: {sorted(set(saved['params']) - names)}, "
                f"only in the optimizer: {sorted(names - set(saved['params']))}"
            )
        params.update(named)
    unknown = sorted(set(state_dict["state"]) - set(params))
    if unknown:
        raise CheckpointMismatchError(
            f"the checkpoint has optimizer state for parameters the optimizer lacks: {unknown}"
        )
    sharded = {tuple(k) for k in state_dict.get(SHARDED_STATE_KEY, [])}

    new_state: dict[Tensor, dict[str, Any]] = {}
    for fqn, entries in state_dict["state"].items():
        p = params[fqn]
        spec = shard_spec(p)
        current = optim.state.get(p, {})
        new_state[p] = {}
        for key, value in entries.items():
            old = current.get(key)
            if isinstance(value, FlatShardedTensor) or (isinstance(value, Tensor) and (fqn, key) in sharded):
                start, stop = local_range(spec, _rank_of(p))
                local = _local_values(value, spec, start, stop, f"optimizer state {fqn}.{key}")
                if not (isinstance(old, Tensor) and old.shape == p.shape and old.dtype == value.dtype):
                    old = torch.zeros(p.shape, dtype=value.dtype, device=p.device)
                _write_local(old, local)
                new_state[p][key] = old
            elif isinstance(value, Tensor):
                if isinstance(old, Tensor) and old.shape == value.shape and old.dtype == value.dtype:
                    if old.data_ptr() != value.data_ptr():
                        old.copy_(value)
                    new_state[p][key] = old
                else:
                    new_state[p][key] = value.detach().clone()
            else:
                new_state[p][key] = copy.deepcopy(value)
    for group, saved in zip(optim.param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params":
                group[k] = v
    optim.state.clear()
    optim.state.update(new_state)
