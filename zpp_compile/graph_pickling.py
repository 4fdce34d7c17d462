"""Graphs with their fake values as bytes: torch's GraphPickler, adapted to zeropp's graphs.

torch.fx._graph_pickler (private; what torch's regional compilation keeps its graphs with) is used
as is except for two points:
  * a view's fake value is described together with its base's, and torch clears the fake mode of
    the view's description only: the base's still holds the process's FakeTensorMode, which pickle
    cannot carry. Both are cleared here; unpickling already puts the new mode into both.
  * the module stacks of a node (nn_module_stack and its forward twin fwd_nn_module_stack) are
    left out: they hold the model's classes, and a sharded model's classes are made per process
    (sharding.py), so pickle cannot find them by name. Nothing after the passes reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _graph_pickler as graph_pickler

_MODULE_STACKS = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack")


class _TensorPickleData(graph_pickler._TensorPickleData):
    def __init__(self, describer: Any, t: Any) -> None:
        super().__init__(describer, t)
        base = self.metadata.base
        if base is not None and base.fake_mode is not None:
            self.metadata = dataclasses.replace(self.metadata, base=dataclasses.replace(base, fake_mode=None))


class _GraphPickler(graph_pickler.GraphPickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, FakeTensor):
            return _TensorPickleData.unpickle, (
                _TensorPickleData(self._meta_tensor_describer, obj),
                self._unpickle_state,
            )
        return super().reducer_override(obj)


def _kept_metadata(key: str) -> bool:
    return key not in _MODULE_STACKS


def dumps(obj: object) -> bytes:
    return _GraphPickler.dumps(
        obj, options=graph_pickler.Options(ops_filter=None, node_metadata_key_filter=_kept_metadata)
    )


def loads(data: bytes, fake_mode: Any) -> Any:
    return graph_pickler.GraphPickler.loads(data, fake_mode)
