"""Optimizer state dicts keyed by parameter name, sharded like the model (no communication).

The layout is that of torch.distributed.checkpoint.state_dict.get_optimizer_state_dict:
    {"state": {fqn: {key: value}}, "param_groups": [{hyper-parameters..., "params": [fqn, ...]}]}
State tensors shaped like their parameter (AdamW's exp_avg, exp_avg_sq) are DTensors like the
parameter, so DCP saves each rank's chunk and reshards on load; scalars (AdamW's step) are plain
tensors, equal on every rank. Either torch's functions or these two read and write it.

torch's own Optimizer.load_state_dict keeps the loaded state tensors as they are, so state read
back from another rank's torch.save would step this rank's chunk with rank 0's moments: a global
step pre-hook (install_optimizer_check) checks each optimizer's state with check_own_chunk at
its first step and at the first after each load_state_dict.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Iterable

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..dtensor_ops import is_zpp_dtensor
from ..layout import shard_spec, sharded_state, state_of_shard, unwrap_compiled
from .state_dict import CheckpointMismatchError, _local_values, check_own_chunk


def _optimizer_params(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[tuple[str, Tensor]]]:
    """(fqn, parameter) per parameter of each param group; refuses parameters not sharded by `model`."""
    state = sharded_state(model)
    groups = []
    for i, group in enumerate(optim.param_groups):
        named = []
        for p in group["params"]:
            spec = shard_spec(p)
            if spec is None or state_of_shard(p) is not state:
                raise ValueError(
                    f"param group {i} of the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of this sharded model: build the optimizer on model.parameters() after "
                    "zpp_compile.shard(model)"
                )
            named.append((spec.fqn, p))
        groups.append(named)
    return groups


def optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the model (no communication).

    Tied parameters appear once, under the name shard() gave them (the first one).
    """
    model = unwrap_compiled(model)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group, named in zip(optim.param_groups, _optimizer_params(model, optim)):
        for fqn, p in named:
            if optim.state.get(p):
                state[fqn] = dict(optim.state[p])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [fqn for fqn, _ in named]})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a state dict of optimizer_state_dict() (or of torch's get_optimizer_state_dict, full or
    sharded): DTensor state of any layout, or full tensors, for parameter-shaped state.

    Works on a fresh optimizer (no state yet): the state tensors are created. Hyper-parameters of
    the param groups are taken from the state dict, as torch.optim.Optimizer.load_state_dict does.
    """
    model = unwrap_compiled(model)
    params = _check_groups(model, optim, state_dict)
    _init_optim_state(optim)  # entries of the right types (DTensor or plain) to load into
    new_state: dict[Tensor, dict[str, Any]] = {}
    for fqn, entries in state_dict["state"].items():
        p = params[fqn]
        current = optim.state.get(p, {})
        new_state[p] = {
            key: _state_value(p, value, current.get(key), f"optimizer state {fqn}.{key}")
            for key, value in entries.items()
        }
    for group, saved in zip(optim.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optim.state.clear()
    optim.state.update(new_state)


def _check_groups(model: nn.Module, optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Tensor]:
    """{fqn: parameter} of the optimizer, after checking the saved groups name the same parameters."""
    named_groups = _optimizer_params(model, optim)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(named_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved_groups)} optimizer param groups, the optimizer {len(named_groups)}"
        )
    check_hyper_parameter_keys([group.keys() for group in saved_groups], optim, "the state dict")
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
    return params


def optimizer_class_name(optim: torch.optim.Optimizer) -> str:
    """The optimizer's module-qualified class name, e.g. "torch.optim.adamw.AdamW"."""
    return f"{type(optim).__module__}.{type(optim).__qualname__}"


def check_hyper_parameter_keys(saved_groups: list[Iterable[str]], optim: torch.optim.Optimizer, source: str) -> None:
    """Raise CheckpointMismatchError unless each saved param group has the hyper-parameter keys
    of the optimizer's group: state of another optimizer class would load and step with the
    wrong hyper-parameters (AdamW's betas in SGD) without any error."""
    for i, (saved, group) in enumerate(zip(saved_groups, optim.param_groups)):
        saved_keys, own_keys = set(saved) - {"params"}, set(group) - {"params"}
        if saved_keys != own_keys:
            raise CheckpointMismatchError(
                f"param group {i} of {source} has the hyper-parameters {sorted(saved_keys)}, the "
                f"{type(optim).__name__} optimizer's have {sorted(own_keys)} (only in {source}: "
                f"{sorted(saved_keys - own_keys)}; only in the optimizer: {sorted(own_keys - saved_keys)}): it was "
                "saved from another optimizer class: build the optimizer it was saved from, or load the model "
                "alone (load_checkpoint(path, model)) and start this optimizer fresh"
            )


def _state_value(p: DTensor, value: Any, old: Any, key: str) -> Any:
    """The state entry to keep, in the type and place of `old` (the optimizer's own entry, created
    by a zero-lr step if it had none): DTensor state gets this rank's chunk of `value` in place
    (nothing to do when DCP loaded into it), plain state (AdamW's step) a copy of `value`."""
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    if value is old:
        return old
    if old is None and value.shape == p.shape and p.dim() and not isinstance(value, DTensor):
        old = torch.zeros_like(p, dtype=value.dtype)  # a parameter-shaped entry the optimizer had not made
    if isinstance(old, DTensor) and old.shape == value.shape:
        old.to_local().copy_(_local_values(p, value, key))
        return old
    if isinstance(old, Tensor) and old.shape == value.shape and not isinstance(value, DTensor):
        old.copy_(value)
        return old
    return value.detach().clone()


# Optimizers whose state has been checked since it was last loaded: Optimizer.load_state_dict
# (whose post-hook drops the optimizer from here) replaces the state, checked at the next step.
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_WATCHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_STEP_HOOK: list = []


def install_optimizer_check() -> None:
    """Check loaded optimizer state for other ranks' chunks before steps (idempotent; shard() calls it)."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_check_loaded_state))


def _check_loaded_state(optim: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if optim in _CHECKED:
        return
    if optim not in _WATCHED:
        optim.register_load_state_dict_post_hook(_forget_checked)
        _WATCHED.add(optim)
    for param, entries in optim.state.items():
        if is_zpp_dtensor(param) and isinstance(entries, dict):
            for key, value in entries.items():
                if isinstance(value, DTensor):
                    check_own_chunk(value, param, f"optimizer state {shard_spec(param).fqn}.{key}")
    _CHECKED.add(optim)


def _forget_checked(optim: torch.optim.Optimizer) -> None:
    """A module-level function: the optimizer still deep-copies and pickles with it registered."""
    _CHECKED.discard(optim)
