"""Graphs with their fake values as bytes: torch's GraphPickler, adapted to zeropp's graphs.

torch.fx._graph_pickler (private; what torch's regional compilation keeps its graphs with) is used
as is except for three points:
  * plain fake tensors (dense, static shapes) are kept as their geometry, and a view as its base
    and its geometry, and made again directly. torch describes every tensor in full and rebuilds
    it through its meta converter: about 0.3 ms a tensor, and a full ZeRO++ graph pair of GPT-2
    small has some 14,000 of them (several seconds of every warm start). Anything else (symbolic
    shapes, subclasses, other layouts) takes torch's way.
  * there, a view's fake value is described together with its base's, and torch clears the fake
    mode of the view's description only: the base's still holds the process's FakeTensorMode,
    which pickle cannot carry. Both are cleared here; unpickling already puts the new mode into both.
  * the module stacks of a node (nn_module_stack and its forward twin fwd_nn_module_stack) are
    left out: they hold the model's classes, and a sharded model's classes are made per process
    (sharding.py), so pickle cannot find them by name. Nothing after the passes reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _graph_pickler as graph_pickler
from torch.utils._mode_utils import no_dispatch

from .passes.graph_utils import has_static_geometry

_MODULE_STACKS = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack")


class _TensorPickleData(graph_pickler._TensorPickleData):
    def __init__(self, describer: Any, t: Any) -> None:
        super().__init__(describer, t)
        base = self.metadata.base
        if base is not None and base.fake_mode is not None:
            self.metadata = dataclasses.replace(self.metadata, base=dataclasses.replace(base, fake_mode=None))


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _is_plain(t: torch.Tensor) -> bool:
    """A dense fake tensor with static sizes, strides and offset (no SymInt among them)."""
    return type(t) is FakeTensor and t.layout == torch.strided and not t.is_quantized and has_static_geometry(t)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _shared_storages(gm: fx.GraphModule) -> set[int]:
    """The storages of gm's fake values that hold more than one base tensor and its views (e.g. a
    dtype view, which fake tensors do not mark as a view): torch's way keeps their sharing, the
    direct one would not."""
    roots: dict[int, int] = {}
    shared = set()
    for node in gm.graph.nodes:
        for t in pytree.tree_leaves(node.meta.get("val")):
            if not isinstance(t, FakeTensor) or t.layout != torch.strided:
                continue
            root = t._base if t._is_view() else t
            if roots.setdefault(_storage(t), id(root)) != id(root):
                shared.add(_storage(t))
    return shared


def _plain_reduction(t: FakeTensor, state: Any) -> Any:
    """(rebuild, args) for a plain tensor or a view of one; None where torch's way is needed."""
    if not _is_plain(t):
        return None
    if t._is_view():
        base = t._base
        if not _is_plain(base) or base._is_view():
            return None
        return _rebuild_view, (base, *_geometry(t))
    if t.storage_offset() != 0:
        return None
    return _rebuild, (*_geometry(t)[:2], t.dtype, t.device, t.requires_grad, state)


def _rebuild(
    shape: tuple, stride: tuple, dtype: torch.dtype, device: torch.device, grad: bool, state: Any
) -> FakeTensor:
    with no_dispatch():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=grad)
        return FakeTensor(state.fake_mode, meta, device)


def _rebuild_view(base: FakeTensor, shape: tuple, stride: tuple, offset: int) -> FakeTensor:
    with torch.no_grad():
        return base.as_strided(shape, stride, offset)


class _GraphPickler(graph_pickler.GraphPickler):
    shared: set[int] = set()  # storages that take torch's way (_shared_storages): set per dump

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, FakeTensor):
            plain = None if _storage(obj) in self.shared else _plain_reduction(obj, self._unpickle_state)
            if plain is not None:
                return plain
            return _TensorPickleData.unpickle, (
                _TensorPickleData(self._meta_tensor_describer, obj),
                self._unpickle_state,
            )
        return super().reducer_override(obj)


def _kept_metadata(key: str) -> bool:
    return key not in _MODULE_STACKS


def dumps(gm: fx.GraphModule) -> bytes:
    pickler = type("_GraphPicklerOfOneGraph", (_GraphPickler,), {"shared": _shared_storages(gm)})
    return pickler.dumps(gm, options=graph_pickler.Options(ops_filter=None, node_metadata_key_filter=_kept_metadata))


def loads(data: bytes, fake_mode: Any) -> Any:
    return graph_pickler.GraphPickler.loads(data, fake_mode)
