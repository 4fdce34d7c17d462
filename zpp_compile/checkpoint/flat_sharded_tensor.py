"""FlatShardedTensor, the state-dict value of a shard, and its geometry.

A flat range [start, stop) of a row-major tensor is cut into boxes that are contiguous in memory
(flat_boxes); FlatShardedTensor presents them to torch.distributed.checkpoint through DCP's chunk
protocol, so each rank writes and reads only its own elements.

Why a tensor subclass of our own: DTensor cannot describe "shard 1-D flattened, padded, of an
N-d tensor" with the original shape, and ShardedTensor, which could (as several local shards),
is deprecated in favour of DTensor (FutureWarnings on use). DCP's chunk protocol is what both of
them implement for checkpointing, and it is all a checkpoint entry needs.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..sharding import ShardSpec

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
