"""ZeRO-3 partitioning: every parameter becomes a DTensor holding this rank's chunk (layout.py).

After `shard(model)`, each module keeps its parameters in `_parameters` under the original names,
now DTensors of the original shape: `model.parameters()` yields them, any optimizer steps on their
local chunks, and torch's own utilities (clip_grad_norm_, state dicts, DCP, nn.init, shape-based
parameter groups) read them as the full parameters they stand for.

Reading `module.weight` goes through a property on a per-class subclass of the module:
  * inside a forward of the model it calls `zpp::gather_param` on the local chunk: eagerly an
    all-gather (and a reduce-scatter of the gradient in backward); under torch.compile the
    marker the backend's passes rewrite;
  * outside any forward it returns the sharded parameter itself, so reads are local and
    collective-free and writes (`nn.init.zeros_(m.fc.weight)`, `m.fc.weight.data.fill_(7)`) land
    in the shard, as with FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from typing import Collection, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_map

from . import dtensor_ops, regather, schedule_check
from .agreement import agree_on_model
from .auto_plan import choose_keep_whole_numel, kept_whole_names, settle_budget
from .codegen.quantize import num_blocks, quantize_packed
from .config import Config
from .cost_model import build_cost_model
from .faults import explained_collective_failures
from .grad_sync import grad_sync_kwargs
from .hugging_face import outermost_transformers_models, pin_fallback_losses
from .layout import (
    PAYLOAD_SUFFIX,
    ShardedState,
    ShardingError,
    ShardSpec,
    int8_payload,
    is_sharded,
    join_fqn,
    shard_spec,
    sharded_state,
    state_dict_tensors,
    state_of_part,
    unwrap_compiled,
)
from .plan_trial import agreed_kept_plans
from .pretrained_saving import install_pretrained_saving
from .process_state import register_reset
from .topology import Topology, build_topology, require_initialized, set_current_topology
from .transformers_methods import adapt_transformers_methods

__all__ = [
    "ShardingError",
    "broadcast_buffers",
    "full_state_dict",
    "gather_full",
    "is_sharded",
    "shard",
    "sharded_state",
]

_PLAN_IDS = itertools.count()


def _check_parameter_names(config: Config, specs: dict[str, ShardSpec]) -> None:
    """Config.hpz_parameters and qwz_parameters name parameters of this model only."""
    for field in ("hpz_parameters", "qwz_parameters"):
        unknown = sorted(set(getattr(config, field) or ()) - specs.keys())
        if unknown:
            raise ShardingError(
                f"Config.{field} names {unknown}, which the model has no parameter called; use the names "
                f"model.named_parameters() gives (e.g. {next(iter(specs), '')!r})."
            )


def shard(model: nn.Module, config: Optional[Config] = None, *, sync_module_states: bool = True) -> nn.Module:
    """Partition every parameter of `model` across the world (ZeRO-3), in place; returns `model`.

    Collective: every rank calls it, with the same Config and the same model. With
    `sync_module_states` (default) rank 0's parameters and buffers are broadcast first, so ranks
    that initialised differently still train one model.
    """
    require_initialized("zpp_compile.shard")
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"shard() takes a zpp_compile.Config, got {type(config).__name__}.")
    _refuse_resharding(model)
    topology = build_topology(config)
    agree_on_model(model, config)
    set_current_topology(topology)
    on_meta = _single_device(model).type == "meta"
    if on_meta and config.quantize_frozen_weights and any(not p.requires_grad for p in model.parameters()):
        raise ShardingError(
            "Config(quantize_frozen_weights=True) quantizes frozen weights at shard() from their values, and "
            "this model is on the meta device: build it with its weights (or load them, then shard), or "
            "leave quantize_frozen_weights off for meta-device initialization."
        )
    device = _training_device(_single_device(model))
    if sync_module_states:
        _broadcast_from_rank0(model)

    state = ShardedState(
        config=config,
        topology=topology,
        specs={},
        mesh=dtensor_ops.world_mesh(topology.world_group_name, device.type),
        cost_model=build_cost_model(config, device=device, topology=topology) if config.prefetch_limit else None,
        plan_id=next(_PLAN_IDS),
        keep_whole_numel=config.keep_whole_numel,
    )
    specs = _specs_by_parameter(model, topology, config, state.plan_id)
    state.specs = {spec.fqn: spec for spec in specs.values()}
    _check_parameter_names(config, state.specs)
    if config.auto_plan:  # before any parameter is replaced: a refused budget leaves the model as it was
        settle_budget(state, device)
        state.keep_whole_numel = choose_keep_whole_numel(state)
        if config.plan_trial_steps:
            state.kept_by_trials = agreed_kept_plans(state, device)
    _keep_whole(specs, kept_whole_names(specs.values(), state.keep_whole_numel))
    state.specs = {spec.fqn: spec for spec in specs.values()}
    shards: dict[int, nn.Parameter] = {}  # id(full parameter) -> its DTensor, so tied weights stay tied
    for module in model.modules():  # a module reused twice is sharded once
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            full = module._parameters[name]
            if id(full) not in shards:
                shards[id(full)] = _make_sharded_parameter(full, specs[id(full)], state)
            _place(module, name, shards[id(full)])
        if names or module is model:  # the root counts its forward even without parameters of its own
            _route_reads_through_gather(module, names)
    _warn_on_block_padding(state)
    _warn_on_running_statistics(model)
    model.register_forward_pre_hook(_refuse_unsharded_parameters)
    if config.param_dtype is not None:
        model.register_forward_pre_hook(_inputs_caster(config.param_dtype), with_kwargs=True)
    model._zpp_state = state
    schedule_check.CHECKED_RUNS.configure(config.checked_runs)
    _refuse_data_parallel_wrapping(model)
    install_pretrained_saving(model, full_state_dict)
    adapt_transformers_methods(model, state.topology.world_size)
    _tell_hugging_face_trainer(model)
    pin_fallback_losses(model)
    dtensor_ops.install()
    from .checkpoint.optimizer import install_optimizer_check  # noqa: PLC0415  (checkpoint imports layout)
    from .checkpoint.state_dict import install_state_dict_hooks  # noqa: PLC0415

    install_state_dict_hooks(model)
    install_optimizer_check()
    return model


def _specs_by_parameter(model: nn.Module, topology: Topology, config: Config, plan_id: int) -> dict[int, ShardSpec]:
    """id(full parameter) -> its ShardSpec, named by its first slot (tied weights share one)."""
    specs: dict[int, ShardSpec] = {}
    for module_name, module in model.named_modules():
        for name, full in module._parameters.items():
            if full is not None and id(full) not in specs:
                specs[id(full)] = _spec_for(join_fqn(module_name, name), full, topology, config, plan_id)
    return specs


def _keep_whole(specs: dict[int, ShardSpec], names: set[str]) -> None:
    """Mark the named parameters' specs kept whole (replicated on every rank)."""
    for key, spec in specs.items():
        if spec.fqn in names:
            specs[key] = dataclasses.replace(spec, kept_whole=True)


def _place(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put the sharded parameter (and a frozen weight's int8 payload) into `module`."""
    module._parameters[name] = param
    module.__dict__.setdefault("_zpp_specs", {})[name] = shard_spec(param)
    payload = getattr(param, "_zpp_payload", None)
    if payload is not None:
        module.register_buffer(name + PAYLOAD_SUFFIX, payload, persistent=False)


# A block size that pads the model's shards to this many times their size is worth a warning.
BLOCK_PADDING_WARNING = 1.5


def _warn_on_block_padding(state: ShardedState) -> None:
    """Quantization blocks never straddle two parameters: each shard is padded to whole blocks.
    Blocks much larger than the shards multiply the bytes on the wire (and the kernels' work)."""
    config = state.config
    sharded = [s for s in state.specs.values() if not s.replicated]
    for name, enabled in (
        ("weight_block_size", config.quantize_weights),
        ("gradient_block_size", config.quantize_gradients),
    ):
        block = getattr(config, name)
        elements = sum(s.shard_numel for s in sharded)
        padded = sum(num_blocks(s.shard_numel, block) * block for s in sharded)
        if enabled and elements and padded > BLOCK_PADDING_WARNING * elements:
            warnings.warn(
                f"Config.{name}={block} pads this model's shards from {elements} to {padded} elements per "
                f"rank ({padded / elements:.1f}x the bytes and work): its shards are small against the block. "
                "Use a smaller block (the default), or leave quantization off for a model this small.",
                stacklevel=3,
            )


def _inputs_caster(dtype: torch.dtype):
    """A forward pre-hook casting the root's floating-point tensor inputs to the compute dtype."""

    def cast(x):
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return cast_inputs


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, names: Optional[Collection[str]] = None
) -> dict[str, Tensor]:
    """The unsharded state dict (every name, tied ones too), gathered; for export.

    Collective: every rank must call it, with the same `names`. Each rank holds one unsharded
    parameter at a time besides the result; with `rank0_only` the other ranks return {} (what a
    single writer needs). `names`: only these entries, the others are not gathered (a PEFT adapter
    out of a large model). `model` may be a part of a sharded model (the transformers model inside
    a sharded PEFT model). Frozen weights stored int8 come back dequantized; under mixed precision,
    the fp32 masters.
    """
    model = unwrap_compiled(model)
    state = state_of_part(model)
    from .checkpoint.state_dict import full_value  # noqa: PLC0415

    keep = not rank0_only or state.topology.rank == 0
    wanted = (lambda fqn: True) if names is None else set(names).__contains__
    out: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}  # tied names share one gather (and one tensor, as unsharded)
    with explained_collective_failures(
        "full_state_dict (collective: call it, and save_pretrained, on every rank)",
        state.topology.collective_timeout_s,
    ):
        for fqn, module, name, t in state_dict_tensors(model):
            if not wanted(fqn):
                continue
            if name not in module._parameters:  # a buffer: every rank holds it whole
                if keep:
                    out[fqn] = t.detach().clone()
                continue
            if id(t) not in gathered:
                value = full_value(module, name, t)  # a collective on every rank, kept on some
                gathered[id(t)] = value if keep else None
            if keep:
                out[fqn] = gathered[id(t)]
    return out


class _RefusedByZeroSharding:
    """Stands in for the list of parameters DistributedDataParallel should leave alone: DDP reads it
    first when it wraps a module, so reading it is where the wrapping is refused."""

    def __iter__(self):
        raise ShardingError(
            "DistributedDataParallel(model) around a zpp_compile-sharded model: DDP would broadcast rank "
            "0's shards over every other rank's and average gradients a second time. zpp_compile "
            "already trains data-parallel: use the sharded model as it is. Hugging Face Trainer needs "
            "nothing (shard() tells it not to wrap the model); with Accelerate, pass the optimizer and "
            "data loaders to accelerator.prepare(), not the model. See README, 'Launchers that wrap the "
            "model in DDP'."
        )


def _refuse_data_parallel_wrapping(model: nn.Module) -> None:
    model._ddp_params_and_buffers_to_ignore = _RefusedByZeroSharding()


def _tell_hugging_face_trainer(model: nn.Module) -> None:
    """Hugging Face Trainer (transformers 5) skips its DDP wrap for a model whose
    is_distributed_loading_by_transformers is True: the model "owns its placement and gradient
    reduction", which a sharded model does. (Trainer then also asks for save_only_model=True.)
    Set on the root and on each outermost transformers model inside: a PEFT model answers the
    attribute from the transformers model it wraps."""
    for module in (model, *(inner for _, inner in outermost_transformers_models(model))):
        if isinstance(getattr(type(module), "is_distributed_loading_by_transformers", None), property):
            module._is_distributed_loading_by_transformers = True


def gather_full(param: Tensor, *, payload: Optional[Tensor] = None, in_compute_dtype: bool = True) -> Tensor:
    """The full parameter for a sharded one: the marker call every module read in forward makes.

    `payload`: the int8 payload of a frozen weight stored quantized (the parameter then holds no
    values). in_compute_dtype=False gathers the master values (the shard's dtype) even under
    mixed precision: what export wants.
    """
    spec = param._zpp_spec  # read directly, as below: Dynamo traces this for every parameter read
    # Branching on plan_id makes Dynamo guard on it: a graph compiled for one shard() call (its
    # Config, topology, cost model) is never reused for parameters of another, which would
    # otherwise match every tensor guard and silently run the first model's plan.
    if spec.plan_id < 0:
        raise AssertionError("unreachable: plan ids count from 0")
    # Likewise on whether it lies in a repeated block: a graph keeps the forward's last weights
    # outside the blocks for its backward (passes/recompute.py), decided when it is compiled, so
    # a graph compiled for a module outside the blocks must not run for one inside them.
    if spec.in_block is None:
        raise AssertionError("unreachable: in_block is a bool")
    if spec.quantized_block is not None:
        compute_dtype = spec.compute_dtype if in_compute_dtype else None
        return torch.ops.zpp.gather_quantized_param(
            payload,
            spec.numel,
            list(spec.shape),
            spec.shard_numel,
            spec.quantized_block,
            compute_dtype or spec.dtype,
            spec.group_size,
            spec.group_name,
            **_name_for_eager(spec),
        )
    kwargs = (spec.gather_kwargs if in_compute_dtype else {}) | _name_for_eager(spec)
    if in_compute_dtype and param.requires_grad and torch.is_grad_enabled():
        # Under no_sync (or the flush after it) the backward accumulates or adds the buffer of
        # this parameter: the mode and the buffer's key are in the graph (Dynamo guards on them).
        kwargs = kwargs | grad_sync_kwargs(param._zpp_state, spec.fqn)
    local = param.to_local()
    if spec.replicated:
        return torch.ops.zpp.replicated_param(local, spec.group_size, spec.group_name, **kwargs)
    return torch.ops.zpp.gather_param(local, *spec.gather_args, **kwargs)


def _name_for_eager(spec: ShardSpec) -> dict[str, str]:
    """The parameter's name for the eager collectives' schedule check. Not under tracing: a name in
    a graph would specialise it to one module (compiled graphs are named at run time instead)."""
    return {} if torch.compiler.is_compiling() else {"fqn": spec.fqn}


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
        quantized_block=config.weight_block_size if stored_quantized and full.dim() else None,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        device=full.device,
        plan_id=plan_id,
        requires_grad=full.requires_grad,
    )


def local_chunk(full: Tensor, spec: ShardSpec, rank: int) -> Tensor:
    """`rank`'s part of a full tensor of spec's shape (a parameter or its gradient), as a copy."""
    if spec.replicated:
        return full.detach().clone()
    start, stop = spec.row_range(rank)
    return full.detach()[start:stop].clone()


def padded_flat_chunk(local: Tensor, spec: ShardSpec) -> Tensor:
    """A local chunk as the collectives send it: flat, zero-padded to spec.shard_numel."""
    flat = local.reshape(-1)
    return torch.nn.functional.pad(flat, (0, spec.shard_numel - flat.numel()))


def _make_sharded_parameter(full: nn.Parameter, spec: ShardSpec, state: ShardedState) -> nn.Parameter:
    rank = state.topology.rank
    local = local_chunk(full, spec, rank)
    payload = None
    if spec.quantized_block is not None:
        # Quantized once, here: frozen weights never change. The parameter keeps its shape and
        # dtype but no values of its own (NaN reads, refused writes); the payload holds them.
        payload = quantize_packed(padded_flat_chunk(local, spec), spec.quantized_block)
        local = torch.full((1,), float("nan"), dtype=full.dtype, device=full.device).expand(local.shape)
    placement = Replicate() if spec.replicated else Shard(0)
    dtensor = DTensor.from_local(
        local, state.mesh, [placement], shape=full.shape, stride=full.stride(), run_check=False
    )
    param = nn.Parameter(dtensor, requires_grad=full.requires_grad)
    param._zpp_spec = spec
    param._zpp_state = state
    if payload is not None:
        payload._zpp_spec = spec
        payload._zpp_state = state
        param._zpp_payload = payload
    return param


def _single_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ShardingError(
            f"the model's parameters are on several devices ({sorted(map(str, devices))}); zpp_compile "
            "shards a model that lives on one device per rank: move it first (model.to(device))."
        )
    return devices.pop() if devices else torch.device("cpu")


def _training_device(device: torch.device) -> torch.device:
    """Where the model trains: its parameters' device, or for a model on the meta device (built
    before being materialized) the one its process group talks on (CUDA under NCCL)."""
    if device.type != "meta":
        return device
    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _refuse_resharding(model: nn.Module) -> None:
    """Refuse a model whose parameters are already distributed: by an earlier shard() (of it or a
    submodule), or by another library (DDP, FSDP1 or FSDP2, tensor parallelism), whose hooks and
    collectives would reduce gradients twice or fail deep inside DTensor."""
    if is_sharded(model):
        raise RuntimeError("shard() was already called on this model; call it once, before torch.compile.")
    _refuse_data_parallel_wrappers(model)
    for name, p in model.named_parameters():
        if shard_spec(p) is not None:
            raise RuntimeError(
                f"parameter {name!r} is already a zpp_compile shard (a submodule was sharded before); "
                "call shard() once, on the root module."
            )
        if isinstance(p, DTensor):
            raise ShardingError(
                f"parameter {name!r} is already a DTensor on {p.device_mesh} ({p.placements}), distributed by "
                "another library (tensor parallelism, FSDP2): zpp_compile shards plain parameters. Call "
                "zpp_compile.shard on the model before any other parallelism is applied, and apply none of it."
            )


def _refuse_data_parallel_wrappers(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    wrappers = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            kind = "fully_shard (FSDP2)" if isinstance(module, FSDPModule) else type(module).__name__
            raise ShardingError(
                f"module {name or '(the root)'!r} is already managed by {kind}: zpp_compile shards every "
                "parameter itself (ZeRO-3) and reduces the gradients. Call zpp_compile.shard on the plain "
                "model instead of that wrapper; Config.from_fsdp2 / Config.from_deepspeed map their settings."
            )


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in _unique_tensors(model):
        if not tensor.is_meta:
            dist.broadcast(tensor.data, src=0)


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics), as DDP does before each
    forward (`broadcast_buffers=True`). A forward that updates buffers updates each rank's own from
    its own batch (as under FSDP2), so ranks disagree on them; call this, on every rank, before
    evaluating on every rank. full_state_dict() and checkpoints take rank 0's already. The int8
    payloads of frozen weights (Config.quantize_frozen_weights) are shards, each rank's own: kept."""
    state = sharded_state(model)
    buffers = {id(b): b for n, b in model.named_buffers() if not n.endswith(PAYLOAD_SUFFIX)}.values()
    with explained_collective_failures(
        "broadcast_buffers (collective: call it on every rank)", state.topology.collective_timeout_s
    ):
        for buffer in buffers:
            dist.broadcast(buffer, src=0)


def _warn_on_running_statistics(model: nn.Module) -> None:
    """Ranks train alike but keep running statistics of their own batches: say so, and the fix."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._NormBase)
             and m.track_running_stats]  # fmt: skip
    if norms:
        warnings.warn(
            f"zpp_compile: {len(norms)} normalization layers ({norms[0]}, ...) keep running statistics: each "
            "rank updates its own from its own batch (as under FSDP2; DDP broadcasts rank 0's before every "
            "forward), so ranks disagree on them. Training is unaffected; before evaluating on every rank, "
            "call zpp_compile.broadcast_buffers(model) (checkpoints keep rank 0's).",
            stacklevel=3,
        )


def _unique_tensors(model: nn.Module) -> Iterator[Tensor]:
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


# --------------------------------------------------------------------------------------------
# Inside or outside a forward: the property gathers in one, returns the sharded parameter else.


class _ForwardDepth:
    """How many forwards of sharded modules are running (nested calls count each)."""

    def __init__(self) -> None:
        # An instance attribute from the start: Dynamo guards on the instance's __dict__, and one
        # created by the first `+= 1` (on a class attribute) recompiled every model at its 2nd step.
        self.depth = 0


_FORWARD = _ForwardDepth()


def in_forward() -> bool:
    """True while a forward of a sharded model (or of one of its modules) runs."""
    return _FORWARD.depth > 0


def _counting_forwards(forward):
    """The class's forward, counted while it runs. A method of the (shared) subclass rather than
    forward hooks: hooks are per module, and Dynamo guards on their ids, so every module of a class
    would get graphs of its own (a loop skipped for a graph break, regional compilation)."""

    @functools.wraps(forward)  # keeps the signature Hugging Face's generate() inspects
    def counted_forward(self, *args, **kwargs):
        hooks = _eager_saving_hooks()
        _FORWARD.depth += 1
        try:
            if hooks is None:
                return forward(self, *args, **kwargs)
            with hooks:
                return forward(self, *args, **kwargs)
        finally:
            _FORWARD.depth -= 1

    return counted_forward


def _eager_saving_hooks():
    """regather.py's hooks, around the outermost forward of an eagerly run, differentiated model.

    Not where torch.compile runs the model (Dynamo's frame callback is set): its graphs re-gather
    themselves, and AOTAutograd would trace under the hooks (AOTAutograd took 14.6 s with them,
    10.2 s without, for GPT-2 small in one noisy A/B run). Frames Dynamo gives up then keep their
    gathered weights, as every eager frame did before."""
    if torch.compiler.is_compiling() or _FORWARD.depth > 0 or not torch.is_grad_enabled():
        return None
    if get_eval_frame_callback() is not None:
        return None
    return regather.saving_recipes()


# One subclass per (original class, sharded names): modules of one type share a class, which keeps
# Dynamo's type guards few. It bears the original's name (Hugging Face writes type(model).__name__
# into config.json's architectures).
_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


register_reset(_SHARDED_CLASSES.clear)  # zpp_compile.reset(): the next models get new subclasses


def _route_reads_through_gather(module: nn.Module, names: list[str]) -> None:
    base = getattr(module.__class__, "_zpp_original_class", module.__class__)
    key = (base, tuple(sorted(names)))
    if key not in _SHARDED_CLASSES:
        attrs = {name: _sharded_attribute(name) for name in key[1]}
        attrs["_zpp_original_class"] = base
        attrs["_apply"] = _apply_keeping_shard_attributes
        attrs["forward"] = _counting_forwards(base.forward)
        attrs["__qualname__"] = base.__qualname__
        attrs["__module__"] = base.__module__
        _SHARDED_CLASSES[key] = type(base.__name__, (base,), attrs)
    module.__class__ = _SHARDED_CLASSES[key]


_SHARD_ATTRIBUTES = ("_zpp_spec", "_zpp_state", "_zpp_payload")


def _apply_keeping_shard_attributes(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """nn.Module._apply (to(), to_empty(), half(), ...) swaps a DTensor parameter's contents with
    the converted tensor's (torch.utils.swap_tensors), Python attributes included: put ours back
    on the (same) parameter object afterwards."""
    saved = {
        name: {a: p.__dict__[a] for a in _SHARD_ATTRIBUTES if a in p.__dict__}
        for name, p in self._parameters.items()
        if p is not None
    }
    super(type(self), self)._apply(fn, recurse)
    for name, attributes in saved.items():
        param = self._parameters[name]
        if param is not None:
            param.__dict__.update(attributes)
    return self


def _sharded_attribute(name: str) -> property:
    def read(self: nn.Module) -> Tensor:
        param = self._parameters[name]
        if not in_forward():
            return param  # the sharded parameter itself: local reads, writes land in the shard
        _check_still_sharded(self, name, param)
        payload = int8_payload(self, name)
        full = gather_full(param, payload=payload)
        if not torch.compiler.is_compiling() and torch.is_grad_enabled():
            if not param._zpp_state.config.save_gathered_weights:
                regather.remember(full, functools.partial(gather_full, param, payload=payload), _tail_role(param))
        return full

    return property(read, doc=f"`{name}`: all-gathered inside forward, the sharded DTensor outside it.")


def _tail_role(param: Tensor) -> Optional[str]:
    """What regather's forward tail makes of this weight (Config.keep_last_weights_gathered)."""
    state, spec = param._zpp_state, param._zpp_spec
    config = state.config
    if not config.keep_last_weights_gathered or config.quantizes_weight(spec.fqn) or spec.replicated:
        return None  # a replicated parameter is a local copy: nothing to gather again
    if not state.has_blocks:
        return "last"
    return "in_block" if spec.in_block else "outside_blocks"


def _never_a_frame_of_its_own() -> None:
    """Dynamo inlines a parameter read into the graph of the code that reads it. Called from code
    Dynamo runs eagerly (torch.nn's own forwards, a frame skipped for a graph break in a loop), the
    read would be compiled as a frame of its own, once per module and name until the recompile
    limit: run it as plain Python there instead (the gather is then an eager all-gather). The
    forward wrapper (_counting_forwards) is inlined too, and never traced as a frame of its own."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    # SKIP for the read and for every frame it calls (gather_full, to_local, the op's autograd).
    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    set_code_exec_strategy(_sharded_attribute("weight").fget.__code__, skip)
    # The forward wrapper, run as a frame (the model's own forward; a block's after a graph break),
    # runs as plain Python and the forward it wraps is the frame Dynamo traces. Traced, its
    # try/finally makes any graph break below it one Dynamo cannot resume from: Dynamo traced the
    # whole model once more only to give the frame up (Hugging Face models break on their logging).
    # Where the wrapped forward is torch.nn's own (which Dynamo never traces as a frame: a sharded
    # nn.Linear compiled alone, or called from a frame Dynamo gave up), the module runs eagerly.
    skip_this_frame_only = FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT)
    set_code_exec_strategy(_counting_forwards(nn.Module.forward).__code__, skip_this_frame_only)


_never_a_frame_of_its_own()


def _check_still_sharded(module: nn.Module, name: str, param: Optional[Tensor]) -> None:
    spec = getattr(param, "_zpp_spec", None)  # not shard_spec(): Dynamo traces this per read
    expected = module.__dict__["_zpp_specs"][name]
    # A model sharded on the meta device is materialized once (to_empty / materialize).
    if spec is expected and (param.device == expected.device or expected.device.type == "meta"):
        return
    where = f"parameter {expected.fqn!r} ({getattr(module, '_zpp_original_class', type(module)).__name__}.{name})"
    if spec is expected:
        raise ShardingError(
            f"{where} was moved to {param.device} after zpp_compile.shard() placed it on {expected.device}. "
            "Move the model first (model.to(device)), then call shard(); process groups and compiled "
            "graphs are set up for the device the shards had."
        )
    now = "set to None" if param is None else "replaced by a tensor that is not a shard"
    raise ShardingError(
        f"{where} was {now} after zpp_compile.shard(). To give it new values, write into it "
        "(module.weight.copy_(full_tensor) or nn.init functions, under torch.no_grad()) or load them "
        "(model.load_state_dict(...) takes full tensors); to change the model's structure, do it "
        "before shard(). (A copy of the model made by copy.deepcopy or torch.func.functional_call "
        "holds no shards either.)"
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
                _refuse_added(join_fqn(module_name, name), param)


def _refuse_added(fqn: str, param: Tensor) -> None:
    if shard_spec(param) is None:
        raise ShardingError(
            f"parameter {fqn!r} (shape {tuple(param.shape)}) was added after zpp_compile.shard() and is not "
            "sharded: its gradient would never be averaged across ranks. Add every parameter "
            f"before shard(), or shard a new model.{_PEFT_ORDER_HINT if 'lora_' in fqn else ''}"
        )


_PEFT_ORDER_HINT = " With PEFT: model = get_peft_model(model, config) first, then zpp_compile.shard(model)."
