"""Sharded checkpoints: state dicts and torch.distributed.checkpoint (DCP) without gathering.

A sharded parameter appears in a state dict under its original name and original shape, as a
FlatShardedTensor: a tensor-like object that holds only this rank's flat slice [start, stop) of
the row-major flattened parameter (the shard without its padding). DCP sees it as a tensor of the
original shape made of a few rectangular chunks, each a view of the shard, so every rank writes
and reads only its own elements, and a checkpoint saved at one world size loads at another: DCP
works out which saved chunks overlap which wanted ones. A DCP checkpoint of a sharded model is
therefore an ordinary one: every consumer (`dcp_to_torch_save`, a plain unsharded model with DCP)
sees normal, unpadded tensors. The format is documented in docs/checkpoints.md.

shard() installs state-dict hooks on every module that owns a shard:
  * `module.state_dict()` gives FlatShardedTensors for the sharded parameters (buffers stay plain);
  * `module.load_state_dict(sd)` takes FlatShardedTensors of the same layout (what state_dict()
    gave, possibly filled by DCP) or plain full tensors (an unsharded state dict, e.g. an export):
    each rank copies its own slice into its shard, in place.

Why a tensor subclass of our own: DTensor cannot describe "shard 1-D flattened, padded, of an
N-d tensor" with the original shape, and ShardedTensor, which could (as several local shards),
is deprecated in favour of DTensor (FutureWarnings on use). DCP's chunk protocol is what both of
them implement for checkpointing, and it is all a checkpoint entry needs.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .codegen.quantize import dequantize_packed, quantize_packed
from .sharding import ShardSpec, shard_spec, sharded_state, state_of_shard

PathLike = Union[str, os.PathLike]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"
SHARDED_STATE_KEY = "sharded_state"  # in an optimizer state dict: [[fqn, state key], ...] that are sharded


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model or optimizer it is loaded into (keys, shapes, groups)."""


# --------------------------------------------------------------------------------------------
# The geometry: a flat range of a row-major tensor as boxes that are contiguous in memory.


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of `shape` as (offsets, sizes, flat start) boxes.

    Each box fixes the leading dims to single indices, takes a range of one dim and all of the
    trailing dims, so it is one contiguous run of memory; boxes are as large as possible (at most
    2 * ndim - 1 of them). A 0-d tensor is one box of no dims.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    strides = _strides(shape)
    boxes = []
    pos = start
    while pos < stop:
        # The outermost dim whose whole step (one index of it) starts at pos and fits before stop.
        dim = next(d for d, st in enumerate(strides) if pos % st == 0 and st <= stop - pos)
        stride = strides[dim]
        index = (pos // stride) % shape[dim]
        count = min((stop - pos) // stride, shape[dim] - index)
        offsets = tuple((pos // st) % size for st, size in zip(strides, shape))
        sizes = (1,) * dim + (count,) + tuple(shape[dim + 1 :])
        boxes.append((offsets, sizes, pos))
        pos += count * stride
    return boxes


def local_range(spec: ShardSpec, rank: int) -> tuple[int, int]:
    """The elements [start, stop) of the flattened full tensor that `rank`'s shard holds (no padding)."""
    start = min(rank * spec.shard_numel, spec.numel)
    return start, min(start + spec.shard_numel, spec.numel)


# --------------------------------------------------------------------------------------------
# The state-dict value.


class FlatShardedTensor(torch.Tensor):
    """A state-dict value for a full tensor of shape `shape` of which this rank holds elements
    [start, stop) of the row-major flattening, as the 1-D tensor `local`.

    It speaks DCP's protocol for distributed tensors (__create_write_items__,
    __create_chunk_list__, __get_tensor_shard__), so torch.distributed.checkpoint saves and loads
    it as chunks of one tensor of the full shape, with no communication. It is not a computable
    tensor: read `.local` for this rank's values, or use zpp_compile.full_state_dict(model).
    """

    _local: Tensor
    _start: int
    _boxes: list

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: Tensor, shape: Union[torch.Size, tuple[int, ...]], start: int) -> "FlatShardedTensor":
        shape = torch.Size(shape)
        if local.dim() != 1:
            raise ValueError(f"FlatShardedTensor holds a flat slice; got a local tensor of shape {tuple(local.shape)}")
        if start < 0 or start + local.numel() > math.prod(shape):
            raise ValueError(
                f"elements [{start}, {start + local.numel()}) do not fit a tensor of shape {tuple(shape)}"
            )
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        self._local = local
        self._start = start
        self._boxes = flat_boxes(tuple(shape), start, start + local.numel())
        if math.prod(shape) == 0:  # an empty tensor: one empty chunk (every rank's; DCP keeps one)
            self._boxes = [((0,) * len(shape), tuple(shape), 0)]
        return self

    @property
    def local(self) -> Tensor:
        """This rank's values: elements [start, stop) of the flattened full tensor."""
        return self._local

    @property
    def start(self) -> int:
        return self._start

    @property
    def stop(self) -> int:
        return self._start + self._local.numel()

    def local_chunks(self) -> list[tuple[tuple[int, ...], Tensor]]:
        """(offsets in the full tensor, the chunk as a view of `local`) for each chunk this rank holds."""
        return [(offsets, self._view(sizes, flat)) for offsets, sizes, flat in self._boxes]

    def _view(self, sizes: tuple[int, ...], flat_start: int) -> Tensor:
        begin = flat_start - self._start
        return self._local[begin : begin + math.prod(sizes)].view(sizes)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FlatShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"elements [{self.start}, {self.stop}) of {self.numel()} on this rank)"
        )

    def __deepcopy__(self, memo: dict) -> "FlatShardedTensor":
        return FlatShardedTensor(copy.deepcopy(self._local, memo), self.shape, self._start)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        this = args[0]
        if func is torch.ops.aten.detach.default:
            return FlatShardedTensor(this._local.detach(), this.shape, this._start)
        if func is torch.ops.aten.clone.default:
            return FlatShardedTensor(this._local.clone(), this.shape, this._start)
        if func is torch.ops.aten._to_copy.default:
            return FlatShardedTensor(func(this._local, *args[1:], **kwargs), this.shape, this._start)
        raise TypeError(
            f"{func} is not supported on a FlatShardedTensor (elements [{this.start}, {this.stop}) of a "
            f"sharded tensor of shape {tuple(this.shape)}): read .local for this rank's values, or call "
            "zpp_compile.full_state_dict(model) for full tensors."
        )

    # DCP's protocol for tensors made of chunks (torch.distributed._checkpointable._Checkpointable).

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for offsets, sizes, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for offsets, sizes, _ in self._boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        wanted = tuple(index.offset) if index.offset is not None else None
        for offsets, sizes, flat in self._boxes:
            if offsets == wanted:
                return self._view(sizes, flat)
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {wanted}")


# --------------------------------------------------------------------------------------------
# Model state dicts: hooks installed by shard().


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


# --------------------------------------------------------------------------------------------
# Optimizer state dicts.


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # a torch.compile'd module: the model it wraps


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
    model = _unwrap(model)
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
    model = _unwrap(model)
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


# --------------------------------------------------------------------------------------------
# Whole checkpoints through torch.distributed.checkpoint.


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
    model = _unwrap(model)
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
    model = _unwrap(model)
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
        state[OPTIM_KEY] = _optimizer_load_target(model, optim, metadata, paths, path)
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


def _optimizer_load_target(
    model: nn.Module, optim: torch.optim.Optimizer, metadata: Metadata, paths: dict, where: PathLike
) -> dict:
    """The optimizer entries DCP loads into: existing state tensors where they fit (loaded in
    place), new ones (put into optim.state at once) for a fresh optimizer."""
    if not any(p[0] == OPTIM_KEY for p in paths.values()):
        raise CheckpointMismatchError(f"checkpoint {os.fspath(where)!r} holds no optimizer state")
    # Which state tensors are sharded is itself in the checkpoint (a 0-d parameter's exp_avg and
    # AdamW's step look alike in the metadata): read that list first.
    listing = {OPTIM_KEY: {SHARDED_STATE_KEY: None}}
    dcp.load(listing, checkpoint_id=where)
    sharded = {tuple(k) for k in listing[OPTIM_KEY][SHARDED_STATE_KEY]}
    params = {fqn: p for named in _optimizer_params(model, optim) for fqn, p in named}

    target: dict = {}
    for flat, path in paths.items():
        if path[0] != OPTIM_KEY:
            continue
        md = metadata.state_dict_metadata[flat]
        value = _fresh_value(md)
        if path[1] == "state" and len(path) == 4 and isinstance(md, TensorStorageMetadata):
            fqn, key = path[2], path[3]
            if fqn not in params:
                raise CheckpointMismatchError(
                    f"checkpoint {os.fspath(where)!r} has optimizer state for {fqn!r}, "
                    "which the optimizer does not hold"
                )
            p = params[fqn]
            old = optim.state[p].get(key)
            if (fqn, key) in sharded:
                spec = shard_spec(p)
                if tuple(md.size) != spec.shape:
                    raise CheckpointMismatchError(
                        f"size mismatch for optimizer state {fqn}.{key}: the checkpoint has shape "
                        f"{tuple(md.size)}, the model {spec.shape}"
                    )
                if not (isinstance(old, Tensor) and old.shape == p.shape and old.dtype == md.properties.dtype):
                    old = torch.zeros(p.shape, dtype=md.properties.dtype, device=p.device)
                    optim.state[p][key] = old
                start, stop = local_range(spec, _rank_of(p))
                value = FlatShardedTensor(old[: stop - start], spec.shape, start)
            elif isinstance(old, Tensor) and old.shape == md.size and old.dtype == md.properties.dtype:
                value = old
        _set_path(target, path, value)
    return target[OPTIM_KEY]
