"""ZeRO-3 partitioning: every parameter becomes a flat, padded 1/world shard owned by this rank.

After `shard(model)`, each module keeps its shards in `_parameters` under the original names, so
`model.parameters()` yields shards and any optimizer steps on them unchanged. Reading
`module.weight` goes through a property that calls `zpp::gather_param`: eagerly that all-gathers
the full weight (and its backward reduce-scatters the gradient); under torch.compile it is the
marker the backend's passes rewrite.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .codegen.quantize import quantize_packed
from .config import Config
from .cost_model import CostModel, build_cost_model
from .ops import pad_flat, padded_numel
from .topology import Topology, build_topology, require_initialized, set_current_topology


_PLAN_IDS = itertools.count()


class ShardingError(RuntimeError):
    """A sharded model was changed in a way its shards cannot follow (replaced, added, moved)."""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What a shard is a piece of: the full parameter's name, shape and the group it is split over.

    quantized_block is set when the shard is stored as its packed int8 payload
    (Config.quantize_frozen_weights); dtype is then the dtype it dequantizes to.
    compute_dtype / reduce_dtype (mixed precision) are None where they equal the shard's dtype,
    so a model without mixed precision traces exactly the graphs it did before.
    """

    fqn: str
    shape: tuple[int, ...]
    numel: int
    group_size: int
    group_name: str
    dtype: torch.dtype = torch.float32
    quantized_block: Optional[int] = None
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    device: torch.device = torch.device("cpu")  # where the shard lives; moving it later is refused
    plan_id: int = 0  # which shard() call made it: compiled graphs are specialised on it (see gather_full)

    @property
    def shard_numel(self) -> int:
        """Elements of the full parameter each rank owns (padding included)."""
        return padded_numel(self.numel, self.group_size) // self.group_size


@dataclasses.dataclass
class ShardedState:
    """Attached to the root module by shard(): the config and layout every compiled graph reads."""

    config: Config
    topology: Topology
    specs: dict[str, ShardSpec]
    cost_model: Optional[CostModel] = None
    recompile_storm_reported: bool = False


def shard(model: nn.Module, config: Optional[Config] = None, *, sync_module_states: bool = True) -> nn.Module:
    """Partition every parameter of `model` across the world (ZeRO-3), in place; returns `model`.

    With `sync_module_states` (default) rank 0's parameters and buffers are broadcast first, so
    ranks that initialised differently still train one model.
    """
    require_initialized("zpp_compile.shard")
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"shard() takes a zpp_compile.Config, got {type(config).__name__}.")
    _refuse_resharding(model)
    topology = build_topology(config)
    set_current_topology(topology)
    if sync_module_states:
        _broadcast_from_rank0(model)

    cost_model = build_cost_model(config) if config.prefetch_limit else None
    plan_id = next(_PLAN_IDS)
    state = ShardedState(config=config, topology=topology, specs={}, cost_model=cost_model)
    shards: dict[int, nn.Parameter] = {}  # id(full parameter) -> its shard, so tied weights stay tied
    for module_name, module in model.named_modules():  # a module reused twice is sharded once
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            full = module._parameters[name]
            if id(full) not in shards:
                spec = _spec_for(_join(module_name, name), full, topology, config, plan_id)
                state.specs[spec.fqn] = spec
                shards[id(full)] = _make_shard(full, spec, state)
            module._parameters[name] = shards[id(full)]
            module.__dict__.setdefault("_zpp_specs", {})[name] = shard_spec(shards[id(full)])
        if names:
            _route_reads_through_gather(module, names)
    model.register_forward_pre_hook(_refuse_unsharded_parameters)
    if config.param_dtype is not None:
        model.register_forward_pre_hook(_inputs_caster(config.param_dtype), with_kwargs=True)
    model._zpp_state = state
    from .checkpoint import install_state_dict_hooks  # state_dict()/load_state_dict() speak shards

    install_state_dict_hooks(model)
    return model


def _inputs_caster(dtype: torch.dtype):
    """A forward pre-hook casting the root's floating-point tensor inputs to the compute dtype."""

    def cast(x):
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return cast_inputs


def is_sharded(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_zpp_state", None), ShardedState)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module torch.compile(model) wraps (its _orig_mod), or `model` itself."""
    return getattr(model, "_orig_mod", model)


def sharded_state(model: nn.Module) -> ShardedState:
    if not is_sharded(model):
        raise ValueError("this model is not sharded: call zpp_compile.shard(model, zpp_compile.Config()) first.")
    return model._zpp_state


def shard_spec(param: Tensor) -> Optional[ShardSpec]:
    """The ShardSpec of a shard created by shard(), or None for any other tensor."""
    return getattr(param, "_zpp_spec", None)


def state_of_shard(param: Tensor) -> Optional[ShardedState]:
    """The ShardedState of the model a shard belongs to, or None for any other tensor."""
    return getattr(param, "_zpp_state", None)


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict (every name, tied ones too), gathered on every rank; for export.

    Collective: every rank must call it.
    """
    sharded_state(model)
    out: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}  # tied names share one gather (and one tensor, as unsharded)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in gathered:
                    gathered[id(p)] = gather_full(p, in_compute_dtype=False).clone()
                out[_join(module_name, name)] = gathered[id(p)]
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[_join(module_name, name)] = b.detach().clone()
    return out


def gather_full(shard_param: Tensor, *, in_compute_dtype: bool = True) -> Tensor:
    """The full parameter for a shard: the `zpp::gather_param` call every module read makes.

    in_compute_dtype=False gathers the master values (the shard's dtype) even under mixed
    precision: what export and checkpoints want.
    """
    spec = shard_spec(shard_param)
    if not in_compute_dtype:
        spec = dataclasses.replace(spec, compute_dtype=None, reduce_dtype=None)
    # Branching on plan_id makes Dynamo guard on it: a graph compiled for one shard() call (its
    # Config, topology, cost model) is never reused for parameters of another, which would
    # otherwise match every tensor guard and silently run the first model's plan.
    if spec.plan_id < 0:
        raise AssertionError("unreachable: plan ids count from 0")
    if spec.quantized_block is not None:
        return torch.ops.zpp.gather_quantized_param(
            shard_param,
            spec.numel,
            list(spec.shape),
            spec.shard_numel,
            spec.quantized_block,
            spec.compute_dtype or spec.dtype,
            spec.group_size,
            spec.group_name,
        )
    dtypes = {k: v for k, v in (("dtype", spec.compute_dtype), ("reduce_dtype", spec.reduce_dtype)) if v is not None}
    return torch.ops.zpp.gather_param(
        shard_param, spec.numel, list(spec.shape), spec.group_size, spec.group_name, **dtypes
    )


def _spec_for(fqn: str, full: Tensor, topology: Topology, config: Config, plan_id: int) -> ShardSpec:
    stored_quantized = config.quantize_frozen_weights and not full.requires_grad and full.is_floating_point()
    compute_dtype = config.param_dtype if full.is_floating_point() else None
    compute_dtype = None if compute_dtype == full.dtype else compute_dtype
    reduce_dtype = config.reduce_dtype if full.is_floating_point() else None
    if reduce_dtype is None and compute_dtype == torch.float16:
        reduce_dtype = torch.float32  # an fp16 sum over many ranks overflows before the average
    reduce_dtype = None if reduce_dtype == (compute_dtype or full.dtype) else reduce_dtype
    return ShardSpec(
        fqn=fqn,
        shape=tuple(full.shape),
        numel=full.numel(),
        group_size=topology.world_size,
        group_name=topology.world_group_name,
        dtype=full.dtype,
        quantized_block=config.weight_block_size if stored_quantized else None,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        device=full.device,
        plan_id=plan_id,
    )


def local_shard(full: Tensor, spec: ShardSpec, rank: int) -> Tensor:
    """This rank's flat, padded piece of a full tensor (a parameter or its gradient)."""
    flat = pad_flat(full.detach().reshape(-1), spec.shard_numel * spec.group_size)
    return flat[rank * spec.shard_numel : (rank + 1) * spec.shard_numel].clone()


def _make_shard(full: nn.Parameter, spec: ShardSpec, state: ShardedState) -> nn.Parameter:
    local = local_shard(full, spec, state.topology.rank)
    if spec.quantized_block is not None:
        local = quantize_packed(local, spec.quantized_block)  # once, here: frozen weights never change
    shard_param = nn.Parameter(local, requires_grad=full.requires_grad)
    shard_param._zpp_spec = spec
    shard_param._zpp_state = state
    return shard_param


def _refuse_resharding(model: nn.Module) -> None:
    if is_sharded(model):
        raise RuntimeError("shard() was already called on this model; call it once, before torch.compile.")
    for name, p in model.named_parameters():
        if shard_spec(p) is not None:
            raise RuntimeError(
                f"parameter {name!r} is already a zpp_compile shard (a submodule was sharded before); "
                "call shard() once, on the root module."
            )


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in _unique_tensors(model):
        dist.broadcast(tensor.data, src=0)


def _unique_tensors(model: nn.Module) -> Iterator[Tensor]:
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


# One subclass per (original class, sharded names): modules of one type share a class, which keeps
# Dynamo's type guards few.
_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _route_reads_through_gather(module: nn.Module, names: list[str]) -> None:
    base = getattr(module.__class__, "_zpp_original_class", module.__class__)
    key = (base, tuple(sorted(names)))
    if key not in _SHARDED_CLASSES:
        attrs = {name: _gathering_property(name) for name in key[1]}
        attrs["_zpp_original_class"] = base
        _SHARDED_CLASSES[key] = type(f"ZeroSharded{base.__name__}", (base,), attrs)
    module.__class__ = _SHARDED_CLASSES[key]


def _gathering_property(name: str) -> property:
    def read_full_parameter(self: nn.Module) -> Tensor:
        param = self._parameters[name]
        _check_still_sharded(self, name, param)
        return gather_full(param)

    return property(read_full_parameter, doc=f"The full `{name}`, all-gathered from its shards.")


def _check_still_sharded(module: nn.Module, name: str, param: Optional[Tensor]) -> None:
    spec = None if param is None else shard_spec(param)
    expected = module.__dict__["_zpp_specs"][name]
    if spec is expected and param.device == expected.device:
        return
    where = f"parameter {expected.fqn!r} ({getattr(module, '_zpp_original_class', type(module)).__name__}.{name})"
    if param is not None and param.device != expected.device:
        raise ShardingError(
            f"{where} was moved to {param.device} after zpp_compile.shard() placed it on {expected.device}. "
            "Move the model first (model.to(device)), then call shard(); process groups and compiled "
            "graphs are set up for the device the shards had."
        )
    if spec is None:
        now = "set to None" if param is None else "replaced by a tensor that is not a shard"
        raise ShardingError(
            f"{where} was {now} after zpp_compile.shard(). To give it new values, load them "
            "(model.load_state_dict(...) takes full tensors) or copy into the shard under "
            "torch.no_grad(); to change the model's structure, do it before shard(). (A copy of the "
            "model made by copy.deepcopy or torch.func.functional_call holds no shards either.)"
        )


def _refuse_unsharded_parameters(model: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the root: a parameter added after shard() would be trained replicated,
    its gradient never averaged across ranks, which is silent wrong training. Compiled graphs
    check the same in the backend (NotShardedError); this covers the eager path."""
    if torch.compiler.is_compiling():
        return
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if name in module.__dict__.get("_zpp_specs", {}):
                _check_still_sharded(module, name, param)  # replaced or moved: says which
            elif param is not None:
                _refuse_added(_join(module_name, name), param)


def _refuse_added(fqn: str, param: Tensor) -> None:
    if shard_spec(param) is None:
        raise ShardingError(
            f"parameter {fqn!r} (shape {tuple(param.shape)}) was added after zpp_compile.shard() and is not "
            "sharded: its gradient would never be averaged across ranks. Add every parameter "
            "before shard(), or shard a new model."
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
