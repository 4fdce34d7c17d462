"""Traces of the quantizing rewrites (graph_utils.inline_traced), reused instead of traced again.

Tracing a rewrite (make_fx of functionalized torch code on fake inputs) took about a third of the
passes' time. A trace depends only on the function, its arguments and its inputs' shapes, so:
  * within one compile (one fake mode), the parameters of repeated blocks share one trace;
  * across processes, a trace is kept as JSON in <Inductor cache dir>/zpp_compile_traces, keyed
    by a digest of the function, its arguments, its inputs' geometry, the decomposition table
    and the code of torch and zpp_compile (cache_folders.code_version), so a restarted job, and
    the other ranks of a host, read it instead of tracing.

A trace is written only where it can be read back as it was: nodes calling torch ops (OpOverloads)
or getitem on plain arguments. A trace holding a Triton kernel (the kernel side table is the
process's own), a constant tensor, or symbolic shapes stays in memory only. A loaded trace gets
fake values in the current fake mode, as a fresh trace has.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
import os
import tempfile
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef

from ..cache_folders import cache_folder, code_version

log = logging.getLogger(__name__)

TRACE_FOLDER = "zpp_compile_traces"

# Traces by fake mode (one per compiled Dynamo graph): gone with the graph's compile.
_IN_MEMORY: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def cached_trace(
    fn: Callable, fake_args: list, fake_mode: Any, decompositions: Optional[dict], trace: Callable[[], fx.Graph]
) -> tuple[fx.Graph, bool]:
    """The traced graph of fn on fake_args, and whether it was traced before (in this compile; a
    copy of it then needs fake values of its own). `trace()` makes it where no cache has it."""
    key = _trace_key(fn, fake_args, decompositions)
    if key is None:
        return trace(), False
    in_memory = _IN_MEMORY.setdefault(fake_mode, {}) if fake_mode is not None else {}
    if key in in_memory:
        return in_memory[key], True
    path = _path_of(key)
    graph = _load(path, fake_args, fake_mode) if path is not None else None
    if graph is None:
        graph = trace()
        if path is not None:
            _store(graph, path)
    in_memory[key] = graph
    return graph, False


def _trace_key(fn: Callable, fake_args: list, decompositions: Optional[dict]) -> Optional[tuple]:
    """What a trace depends on, or None where that cannot be told (not a functools.partial, or
    symbolic shapes)."""
    if not isinstance(fn, functools.partial) or any(map(_symbolic, fake_args)):
        return None  # a SymInt shape cannot be hashed, and a trace for it would not be reused
    inputs = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in fake_args)
    return fn.func, repr(fn.args), repr(sorted(fn.keywords.items())), inputs, _decompositions_digest(decompositions)


def _path_of(key: tuple) -> Optional[str]:
    """The file a trace with this key is kept in; None where it cannot be kept (see the docstring)."""
    folder = cache_folder(TRACE_FOLDER)
    func, args, keywords, inputs, decompositions = key
    text = repr((func.__module__, func.__qualname__, args, keywords, inputs, decompositions, code_version()))
    if folder is None or " at 0x" in text:  # an object's address: never the same twice
        return None
    return os.path.join(folder, hashlib.sha256(text.encode()).hexdigest() + ".json")


_DECOMPOSITION_DIGESTS: dict[int, tuple[Any, str]] = {}


def _decompositions_digest(decompositions: Optional[dict]) -> str:
    if not decompositions:
        return "none"
    kept = _DECOMPOSITION_DIGESTS.get(id(decompositions))
    if kept is None or kept[0] is not decompositions:
        names = sorted(str(op) for op in decompositions)
        kept = (decompositions, hashlib.sha256("\n".join(names).encode()).hexdigest())
        _DECOMPOSITION_DIGESTS[id(decompositions)] = kept
    return kept[1]


class _NotKept(Exception):
    """A trace with something JSON cannot carry back (see the module docstring)."""


def _store(graph: fx.Graph, path: str) -> None:
    try:
        text = json.dumps([_encode_node(node) for node in graph.nodes])
    except _NotKept as why:
        log.debug("trace not kept (%s)", why)
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a rank reading meanwhile sees the whole file or none
    except OSError as err:
        log.debug("trace not kept: %s", err)


def _load(path: str, fake_args: list, fake_mode: Any) -> Optional[fx.Graph]:
    try:
        with open(path) as f:
            nodes = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        graph = _decode_graph(nodes)
    except (KeyError, AttributeError, TypeError, ValueError, RuntimeError) as err:
        log.warning("zpp_compile: ignoring an unreadable trace %s (%s); tracing again", path, err)
        return None
    _give_fake_values(graph, fake_args, fake_mode)
    return graph


def _give_fake_values(graph: fx.Graph, fake_args: list, fake_mode: Any) -> None:
    """meta["val"] and ["tensor_meta"] on every node, as make_fx leaves them."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, fake_args):
        node.meta["val"] = value
    run_on_fake_values([n for n in graph.nodes if n.op == "call_function"], fake_mode)
    for node in graph.nodes:
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])


def run_on_fake_values(nodes: list[fx.Node], fake_mode: Any) -> None:
    """Run each node's op on its inputs' fake values: new tensors, related as the ops relate them."""
    with fake_mode:
        for node in nodes:
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)


def copy_fake_values(traced: list[fx.Node], copies: dict[fx.Node, fx.Node], fake_mode: Any) -> None:
    """Fake values for a copy of a traced graph: each copied node gets a new tensor of its traced
    node's geometry, and the copies' tensors share storage where the traced ones did (with the
    copy's inputs where the trace's outputs viewed its inputs), as running the ops would relate
    them. Each op ran once on fake values in the trace; running it again per copy (as
    run_on_fake_values does) cost a millisecond an op, most of the quantizing passes' time.
    Symbolic shapes, or a value of another kind, fall back to running the ops."""
    storages: dict[Any, Any] = {}
    for node in traced:
        if node.op == "placeholder":
            storages[StorageWeakRef(node.meta["val"].untyped_storage())] = copies[node].meta["val"].untyped_storage()
    computed = [n for n in traced if n.op == "call_function"]
    try:
        with unset_fake_temporarily():  # meta tensors made under the fake mode would go through it: 30x slower
            values = [_copy_value(node.meta["val"], storages, fake_mode) for node in computed]
    except _NotCopied:
        run_on_fake_values([copies[n] for n in computed], fake_mode)
        return
    for node, value in zip(computed, values):
        copies[node].meta["val"] = value


class _NotCopied(Exception):
    """A traced value copy_fake_values cannot copy (symbolic, or not tensors)."""


def _copy_value(value: Any, storages: dict[Any, Any], fake_mode: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_value(v, storages, fake_mode) for v in value)
    if value is None or type(value) in (int, float, bool):
        return value
    if not isinstance(value, FakeTensor) or value.fake_mode is not fake_mode or _symbolic(value):
        raise _NotCopied
    traced_storage = value.untyped_storage()
    key = StorageWeakRef(traced_storage)
    if key not in storages:
        storages[key] = torch.empty(traced_storage.nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
    geometry = (tuple(value.shape), value.stride(), value.storage_offset())
    return fake_on_storage(storages[key], geometry, value.dtype, value.device, value.requires_grad, fake_mode)


def fake_on_storage(
    storage: Any, geometry: tuple, dtype: torch.dtype, device: torch.device, grad: bool, fake_mode: Any
) -> FakeTensor:
    """A fake tensor of `geometry` (shape, stride, offset) on a meta `storage`, made without
    running any op under the fake mode (call it outside the mode: 30x faster)."""
    shape, stride, offset = geometry
    meta = torch.empty(0, dtype=dtype, device="meta")
    meta.set_(storage, offset, shape, stride)
    meta.requires_grad_(grad)
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, device)


def _symbolic(value: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride(), value.storage_offset()))


# The encoding: a node is {"op", "name", "target", "args", "kwargs"}; a value is JSON's own for
# None, bools and ints, else a one-key object naming its kind.
_ENUMS = {torch.dtype: "dtype", torch.layout: "layout", torch.memory_format: "memory_format"}


def _encode_node(node: fx.Node) -> dict:
    if node.op not in ("placeholder", "call_function", "output"):
        raise _NotKept(f"a {node.op} node")
    return {
        "op": node.op,
        "name": node.name,
        "target": _encode_target(node.target) if node.op == "call_function" else node.target,
        "args": _encode(node.args),
        "kwargs": _encode(node.kwargs),
    }


def _encode_target(target: Any) -> list[str]:
    if target is operator.getitem:
        return ["getitem"]
    if isinstance(target, torch._ops.OpOverload):
        return [target.namespace, target._opname, target._overloadname]
    raise _NotKept(f"a call of {target}")


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int)) and not isinstance(value, torch.SymInt):
        return value
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, float):
        return {"float": repr(value)}  # exact, and inf / nan too
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, (list, tuple)):  # FX's immutable_list is a list
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if type(value) in _ENUMS:
        return {_ENUMS[type(value)]: str(value).removeprefix("torch.")}
    raise _NotKept(f"an argument of type {type(value).__name__}")


def _decode_graph(encoded: list[dict]) -> fx.Graph:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for entry in encoded:
        args, kwargs = _decode(entry["args"], nodes), _decode(entry["kwargs"], nodes)
        if entry["op"] == "placeholder":
            node = graph.placeholder(entry["target"])
        elif entry["op"] == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node("call_function", _decode_target(entry["target"]), args, kwargs, entry["name"])
        nodes[entry["name"]] = node
    graph.lint()
    return graph


def _decode_target(encoded: list[str]) -> Any:
    if encoded == ["getitem"]:
        return operator.getitem
    namespace, name, overload = encoded
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(value, dict):
        return value
    ((kind, inner),) = value.items()
    if kind == "node":
        return nodes[inner]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes) for v in inner]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _decode(v, nodes) for k, v in inner}
    decoders = {"float": float, "str": str, "device": torch.device}
    return decoders[kind](inner) if kind in decoders else getattr(torch, inner)
