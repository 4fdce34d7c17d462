"""Pretrained weights streamed into a sharded model, each rank reading only its own rows.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    zpp_compile.shard(model, zpp_compile.Config())
    zpp_compile.load_safetensors(model, "path/to/checkpoint_dir")   # materializes on the way

A parameter's chunk is whole rows of dim 0 (layout.py): one contiguous run of bytes of a
safetensors file, which each rank reads with one seek and one read (the format is a length, a
JSON header of dtypes, shapes and offsets, then the data), and nothing else: every rank holds at
most its shards plus one parameter's rows. The source is a Hugging Face checkpoint
folder (model.safetensors, or the shards named by model.safetensors.index.json) or one
.safetensors file; load_full_state_dict takes tensors you already have, one at a time.
A tensor the model lacks, a model entry the source lacks, or a shape that differs raises
CheckpointMismatchError naming every one of them, on every rank: before anything is written for a
safetensors source or a mapping; as each arrives, and the missing ones at the end, for pairs.
A PEFT model (LoRA on a meta-device model) loads its base model's checkpoint under the base
model's names; its adapters are initialized as PEFT does (peft_models.py).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .checkpoint.state_dict import CheckpointMismatchError, _load_into_payload
from .layout import int8_payload, shard_spec, sharded_state, unwrap_compiled
from .peft_models import checkpoint_name, copy_modules_to_save, init_adapters, is_peft_model

PathLike = Union[str, os.PathLike]
SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"

# Reads rows [start, stop) of dim 0 of a named tensor (all of a 0-d one).
RowReader = Callable[[int, int], Tensor]


@torch.no_grad()
def load_safetensors(model: nn.Module, source: PathLike, *, strict: bool = True) -> nn.Module:
    """Load a safetensors checkpoint (a Hugging Face folder, or one file) into the sharded `model`,
    each rank reading only its rows; a model still on the meta device is materialized first.

    With `strict`, every entry of the model's state dict must be in the source (tied parameters
    need one of their names) and every tensor of the source in the model. Buffers the source
    lacks (non-persistent ones) keep their values. Returns `model`.
    """
    shapes, readers = {}, {}
    for file in _safetensors_files(Path(source)):
        for key, entry in _safetensors_header(file).items():
            shapes[key] = tuple(entry["shape"])
            readers[key] = functools.partial(_read_rows, file, entry)
    return _load(model, shapes, readers, strict, f"{os.fspath(source)!r}")


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state: Union[Mapping[str, Tensor], Iterable[tuple[str, Tensor]]], *, strict: bool = True
) -> nn.Module:
    """Load full (unsharded) tensors into the sharded `model`, each rank copying its rows; a
    mapping (checked whole before anything is written), or (name, tensor) pairs consumed one at a
    time (a generator yielding one tensor at a time keeps memory at one parameter; each pair is
    checked as it comes, what is missing at the end). Same checks as load_safetensors. Returns `model`."""
    if isinstance(state, Mapping):
        shapes = {name: tuple(t.shape) for name, t in state.items()}
        readers = {name: _rows_of(t) for name, t in state.items()}
        return _load(model, shapes, readers, strict, "the state dict")
    return _load_stream(model, iter(state), strict, "the (name, tensor) pairs")


def _rows_of(t: Tensor) -> RowReader:
    return lambda start, stop: t[start:stop] if t.dim() else t


def _safetensors_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    index = source / SAFE_WEIGHTS_INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [source / n for n in names]
    if (source / SAFE_WEIGHTS).exists():
        return [source / SAFE_WEIGHTS]
    raise FileNotFoundError(f"{os.fspath(source)!r} holds neither {SAFE_WEIGHTS} nor {SAFE_WEIGHTS_INDEX}")


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def _safetensors_header(file: Path) -> dict[str, dict]:
    """The tensors of a .safetensors file: {name: {"dtype", "shape", "data_offsets"}}, with the
    offset of the data section added (a little-endian u64 header length, a JSON header, the data)."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_start"] = 8 + length
    return header


def _read_rows(file: Path, entry: dict, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of dim 0 of one tensor (all of a 0-d one), read straight from the file:
    the rows are one contiguous run of bytes, and nothing else is read."""
    shape, dtype = entry["shape"], _DTYPES[entry["dtype"]]
    out = torch.empty([stop - start, *shape[1:]] if shape else [], dtype=dtype)
    if out.numel():
        row_bytes = math.prod(shape[1:]) * out.element_size()
        with open(file, "rb") as f:
            f.seek(entry["data_start"] + entry["data_offsets"][0] + start * row_bytes)
            f.readinto(memoryview(out.view(torch.uint8).reshape(-1).numpy()))
    return out


def _load(model: nn.Module, shapes: dict, readers: dict[str, RowReader], strict: bool, source: str) -> nn.Module:
    model = unwrap_compiled(model)
    targets = _targets(model)
    _check(targets, shapes, strict, source)
    was_meta = _allocate_if_meta(model, targets, strict)
    targets = _targets(model)
    rank = sharded_state(model).topology.rank
    for key, (module, tensor) in targets.items():
        if key in readers:
            _write(module, key.rsplit(".", 1)[-1], tensor, readers[key], rank)
    if was_meta:
        _fill_unsaved(model, targets, shapes)
    _settle_peft_adapters(model, was_meta)
    return model


def _load_stream(model: nn.Module, pairs: Iterator[tuple[str, Tensor]], strict: bool, source: str) -> nn.Module:
    """_load for pairs that arrive one at a time: each is written (or refused) before the next is
    drawn, so the caller's generator can drop it; the model-wide checks run at the end."""
    model = unwrap_compiled(model)
    was_meta = _allocate_if_meta(model, _targets(model), strict)
    targets = _targets(model)
    rank = sharded_state(model).topology.rank
    shapes = {}
    for key, t in pairs:
        shapes[key] = tuple(t.shape)
        if key in targets:
            _check({key: targets[key]}, {key: shapes[key]}, False, source)
            module, tensor = targets[key]
            _write(module, key.rsplit(".", 1)[-1], tensor, _rows_of(t), rank)
        del t
    _check(targets, shapes, strict, source)
    if was_meta:
        _fill_unsaved(model, targets, shapes)
    _settle_peft_adapters(model, was_meta)
    return model


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _allocate_if_meta(model: nn.Module, targets: dict, strict: bool) -> bool:
    """Allocate a meta-device model's chunks (the source fills them); True if it was on meta."""
    if not any(_local(t).is_meta for _, t in targets.values()):
        return False
    if not strict:
        raise CheckpointMismatchError(
            "loading with strict=False into a model still on the meta device would leave what the source "
            "lacks uninitialized: call zpp_compile.materialize(model, init=...) first"
        )
    model.to_empty(device=torch.device(sharded_state(model).mesh.device_type))
    return True


def _fill_unsaved(model: nn.Module, targets: dict, shapes: dict) -> None:
    """Buffers the source lacks (computed in __init__, not saved: rotary tables) are recomputed by
    Hugging Face's _init_weights where the model has one; anything else left without a value is
    refused."""
    covered = {id(t) for k, (_, t) in targets.items() if k in shapes}  # tied parameters: one name does
    unsaved = [(m, k) for k, (m, t) in targets.items() if id(t) not in covered and t.is_floating_point()]
    init_module = getattr(model, "_init_weights", None)
    if unsaved and not callable(init_module):
        raise CheckpointMismatchError(
            f"buffers {[k for _, k in unsaved]} are not in the source and the model is on the meta device: "
            "call zpp_compile.materialize(model, init=...) (which sets them) before loading"
        )
    for module, _ in unsaved:
        init_module(module)


def _settle_peft_adapters(model: nn.Module, was_meta: bool) -> None:
    """A PEFT model's adapters, which no base checkpoint holds: initialized as PEFT does where the
    model came from the meta device; a module to save's trainable copy takes the loaded values."""
    if not is_peft_model(model):
        return
    if was_meta:
        init_adapters(model)
    else:
        copy_modules_to_save(model)


def _targets(model: nn.Module) -> dict[str, tuple[nn.Module, Tensor]]:
    """{state-dict key: (owning module, parameter or buffer)}, tied names included. A PEFT model's
    under the base model's names, its adapters left out (peft_models.checkpoint_name)."""
    targets = _own_targets(model)
    if not is_peft_model(model):
        return targets
    renamed = ((checkpoint_name(key), target) for key, target in targets.items())
    return {key: target for key, target in renamed if key is not None}


def _own_targets(model: nn.Module) -> dict[str, tuple[nn.Module, Tensor]]:
    targets = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, p in module._parameters.items():
            if p is not None:
                targets[prefix + name] = (module, p)
        for name, b in module._buffers.items():
            if b is not None and not name.endswith("_zpp_int8"):
                targets[prefix + name] = (module, b)
    return targets


def _check(targets: dict, shapes: dict, strict: bool, source: str) -> None:
    problems = []
    wrong = [
        f"{k}: the source has {shapes[k]}, the model {tuple(t.shape)}"
        for k, (_, t) in targets.items()
        if k in shapes and shapes[k] != tuple(t.shape)
    ]
    if wrong:
        problems.append("shape mismatch for " + "; ".join(wrong))
    if strict:
        covered = {id(t) for k, (_, t) in targets.items() if k in shapes}
        persistent = {k for k, (m, t) in targets.items() if k.rsplit(".", 1)[-1] not in m._non_persistent_buffers_set}
        missing = sorted(k for k, (_, t) in targets.items() if k in persistent and id(t) not in covered)
        unexpected = sorted(k for k in shapes if k not in targets)
        if missing:
            problems.append(f"missing from the source: {missing}")
        if unexpected:
            problems.append(f"in the source but not in the model: {unexpected}")
    if problems:
        raise CheckpointMismatchError(f"{source} does not fit the model: " + "; ".join(problems))


def _write(module: nn.Module, name: str, tensor: Tensor, read: RowReader, rank: int) -> None:
    spec = shard_spec(tensor)
    if spec is None:  # a buffer: every rank holds all of it
        tensor.copy_(read(0, tensor.shape[0] if tensor.dim() else 0))
        return
    rows = read(*spec.row_range(rank))
    if int8_payload(module, name) is not None:
        _load_into_payload(module, name, tensor, _as_full_rows(rows, tensor, spec, rank), name)
    else:
        tensor.to_local().copy_(rows)


def _as_full_rows(rows: Tensor, tensor: DTensor, spec: Any, rank: int) -> DTensor:
    """This rank's rows as a DTensor of the parameter's layout (what the int8 payload takes)."""
    return DTensor.from_local(
        rows.to(spec.dtype),
        tensor.device_mesh,
        tensor.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
        run_check=False,
    )
