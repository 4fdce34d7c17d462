"""Graphs with their fake values as bytes: torch's GraphPickler, adapted to zeropp's graphs.

torch.fx._graph_pickler (private; what torch's regional compilation keeps its graphs with) is used
as is except for these points, the first three for the time a warm start spends loading graphs:
  * every plain fake tensor (dense, static shapes) is kept as its storage and geometry, and a view
    as its base and its geometry, and made again directly on one meta storage per original storage:
    sharing (views, dtype views, slices at an offset) comes back as it was. torch describes every
    tensor in full and rebuilds it through its meta converter: about 0.5 ms a tensor, and a full
    ZeRO++ graph pair of GPT-2 small has some 20,000 of them. Anything else (symbolic shapes,
    subclasses, other layouts) takes torch's way.
  * a node's arguments are mapped to and from their records without pytree (_map_nodes).
  * the graph comes back as a _LazyGraphModule: its Python code is made when something reads or
    runs it. A warm start lowers the graph region by region and never runs the whole one.
    (At GPT-2, 12 layers, n_embd 256, full ZeRO++ on 2 x 2 ranks, these took loading the graph
    pair from 17.5 to about 6 s on rank 0.)
  * on torch's way, a view's fake value is described together with its base's, and torch clears
    the fake mode of the view's description only: the base's still holds the process's
    FakeTensorMode, which pickle cannot carry. Both are cleared here; unpickling already puts the
    new mode into both.
  * the module stacks of a node (nn_module_stack and its forward twin fwd_nn_module_stack) are
    left out: they hold the model's classes, and a sharded model's classes are made per process
    (sharding.py), so pickle cannot find them by name. Nothing after the passes reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _graph_pickler as graph_pickler
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._mode_utils import no_dispatch

from .passes.graph_utils import has_static_geometry
from .passes.trace_cache import fake_on_storage

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
    return (
        type(t) is FakeTensor
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_conj() or t.is_neg())
        and has_static_geometry(t)
    )


class _StorageRef:
    """One storage of the graph's fake values. The pickler hands out one object per storage, so
    pickle's memo brings back one object too, and every tensor rebuilt on it shares one meta storage
    (made on first use): views, dtype views and slices at an offset alias as before."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._storage: Any = None

    def __getstate__(self) -> int:
        return self.nbytes

    def __setstate__(self, nbytes: int) -> None:
        self.__init__(nbytes)

    def storage(self) -> Any:
        if self._storage is None:
            self._storage = torch.empty(self.nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        return self._storage


def _rebuild(
    ref: _StorageRef, geometry: tuple, dtype: torch.dtype, device: torch.device, grad: bool, state: Any
) -> FakeTensor:
    with no_dispatch():
        return fake_on_storage(ref.storage(), geometry, dtype, device, grad, state.fake_mode)


def _rebuild_view(base: FakeTensor, shape: tuple, stride: tuple, offset: int) -> FakeTensor:
    with torch.no_grad():
        return base.as_strided(shape, stride, offset)


class _GraphPickler(graph_pickler.GraphPickler):
    """Plain fake tensors as (storage, geometry); a view as its base and its geometry, so it comes
    back a view (Inductor asks `_is_view()` of a value). Anything else takes torch's way."""

    def __init__(self, file: Any, options: Any = None) -> None:
        super().__init__(file, options)
        self._storage_refs: dict[int, _StorageRef] = {}  # a storage's address -> its one ref

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, FakeTensor):
            if _is_plain(obj):
                return self._plain_reduction(obj)
            return _TensorPickleData.unpickle, (
                _TensorPickleData(self._meta_tensor_describer, obj),
                self._unpickle_state,
            )
        if isinstance(obj, fx.GraphModule):
            return _GraphModulePickleData.unpickle, (_GraphModulePickleData(obj, self.options), self._unpickle_state)
        return super().reducer_override(obj)

    def _plain_reduction(self, t: FakeTensor) -> tuple:
        if t._is_view() and _is_plain(t._base) and not t._base._is_view():
            return _rebuild_view, (t._base, *_geometry(t))
        storage = t.untyped_storage()
        ref = self._storage_refs.setdefault(storage._cdata, _StorageRef(storage.nbytes()))
        return _rebuild, (ref, _geometry(t), t.dtype, t.device, t.requires_grad, self._unpickle_state)


def _kept_metadata(key: str) -> bool:
    return key not in _MODULE_STACKS


_SEQUENCES = (tuple, list, immutable_list, torch.Size)
_MAPPINGS = (dict, immutable_dict)


def _map_nodes(value: Any, fn: Callable[[Any], Any], kind: type) -> Any:
    """pytree.tree_map_only(kind, fn, value) for what a node's arguments hold, without pytree's
    tree specs: they were a third of a warm start's unpickling. Other containers take pytree."""
    if isinstance(value, kind):
        return fn(value)
    if type(value) in _SEQUENCES:
        return type(value)([_map_nodes(v, fn, kind) for v in value])
    if type(value) in _MAPPINGS:
        return type(value)({k: _map_nodes(v, fn, kind) for k, v in value.items()})
    if type(value) is slice:
        return slice(*(_map_nodes(v, fn, kind) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list, dict)):
        return pytree.tree_map_only(kind, fn, value)
    return value


class _NodePickleData(graph_pickler._NodePickleData):
    """torch's record of a node (the same fields), made without torch's __init__: that maps the
    arguments with pytree, ~0.1 ms a node even for none (a third of pickling a 20,000-node graph);
    here _map_nodes maps them."""

    def __init__(self, node: fx.Node, mapping: dict, options: Any) -> None:
        self.args = _map_nodes(node.args, mapping.__getitem__, fx.Node)
        self.kwargs = _map_nodes(node.kwargs, mapping.__getitem__, fx.Node)
        self.name, self.op, self.type = node.name, node.op, node.type
        self.target = graph_pickler._OpPickleData.pickle(node.target, options)
        kept = options.node_metadata_key_filter
        self.meta = {key: value for key, value in node.meta.items() if not kept or kept(key)}

    def unpickle(self, graph: fx.Graph, mapping: dict, unpickle_state: Any) -> fx.Node:
        target = self.target.unpickle(unpickle_state)
        args = _map_nodes(self.args, mapping.__getitem__, graph_pickler._NodePickleData)
        kwargs = _map_nodes(self.kwargs, mapping.__getitem__, graph_pickler._NodePickleData)
        node = graph.create_node(self.op, target, args, kwargs, self.name, self.type)
        node.meta = self.meta
        return node


class _GraphPickleData(graph_pickler._GraphPickleData):
    def __init__(self, graph: fx.Graph, options: Any) -> None:
        self.tracer_cls, self.tracer_extras, self._codegen = graph._tracer_cls, graph._tracer_extras, graph._codegen
        nodes: dict[fx.Node, _NodePickleData] = {}
        for node in graph.nodes:
            nodes[node] = _NodePickleData(node, nodes, options)
        self.nodes = tuple(nodes.values())


class _GraphModulePickleData(graph_pickler._GraphModulePickleData):
    """torch's record of a GraphModule, coming back as a _LazyGraphModule: its Python code is made
    when something reads or runs it, not on loading (a warm start lowers the graph region by region
    and never runs the whole one)."""

    def __init__(self, gm: fx.GraphModule, options: Any) -> None:
        # No recompile first, as torch's does (~1 s for a large graph): the loaded module's code
        # is made again from its graph anyway.
        self.gm_dict = gm.__getstate__() if hasattr(gm, "__getstate__") else gm.__dict__.copy()
        del self.gm_dict["_graph"]
        self.graph = _GraphPickleData(gm.graph, options)

    def unpickle(self, unpickle_state: Any) -> fx.GraphModule:
        gm = _LazyGraphModule.__new__(_LazyGraphModule)
        gm.__dict__ = self.gm_dict
        gm._graph = self.graph.unpickle(gm, unpickle_state)
        gm.recompile()  # marks the code stale: made on first use
        return gm


def dumps(gm: fx.GraphModule) -> bytes:
    return _GraphPickler.dumps(
        gm, options=graph_pickler.Options(ops_filter=None, node_metadata_key_filter=_kept_metadata)
    )


def loads(data: bytes, fake_mode: Any) -> fx.GraphModule:
    """The graph `dumps` made, its fake values in `fake_mode`; its code is made on first use."""
    return graph_pickler.GraphPickler.loads(data, fake_mode)
