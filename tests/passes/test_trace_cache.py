"""Traces of the quantizing rewrites kept in the cache folder (zpp_compile/passes/trace_cache.py)."""

import functools
import json
import logging
import os

import pytest
import torch
import torch._inductor.config as inductor_config

from zpp_compile.passes import graph_utils, qwz, trace_cache

from .helpers import context, trace


def _qwz_graph(group_name):
    def f(shard, x):
        return x @ torch.ops.zpp.gather_param(shard, 200, [10, 20], 200, 1, group_name).t()

    shard, x = torch.randn(200), torch.randn(3, 20)
    return qwz(trace(f, shard, x), context(group_name, quantize_weights=True, weight_block_size=64)), (shard, x)


@pytest.fixture
def trace_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / trace_cache.TRACE_FOLDER


@pytest.fixture
def traces_made(monkeypatch):
    made = []
    real = graph_utils._trace

    def counting(*args):
        made.append(args[0])
        return real(*args)

    monkeypatch.setattr(graph_utils, "_trace", counting)
    return made


def test_a_trace_read_back_rewrites_the_graph_as_a_fresh_trace(group_of_one, trace_folder, traces_made):
    fresh, inputs = _qwz_graph(group_of_one)  # a new fake mode each time: only the folder is shared
    assert len(traces_made) == 1 and len(os.listdir(trace_folder)) == 1
    loaded, _ = _qwz_graph(group_of_one)
    assert len(traces_made) == 1, "the second compile traced again instead of reading the kept trace"
    assert loaded.code == fresh.code
    torch.testing.assert_close(loaded(*inputs), fresh(*inputs), rtol=0, atol=0)
    for node in loaded.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            assert "tensor_meta" in node.meta, f"{node.name}: no tensor_meta, which make_fx gives"


def test_a_trace_of_other_code_is_not_read(group_of_one, trace_folder, traces_made, monkeypatch):
    _qwz_graph(group_of_one)
    monkeypatch.setattr(trace_cache, "code_version", lambda: "a later zpp_compile")
    _qwz_graph(group_of_one)
    assert len(traces_made) == 2 and len(os.listdir(trace_folder)) == 2


def test_an_unreadable_trace_is_traced_again_with_a_warning(group_of_one, trace_folder, traces_made, caplog):
    _, inputs = _qwz_graph(group_of_one)
    (path,) = trace_folder.iterdir()
    nodes = json.loads(path.read_text())
    nodes[3]["target"] = ["aten", "no_such_op", "default"]
    path.write_text(json.dumps(nodes))
    with caplog.at_level(logging.WARNING, logger=trace_cache.__name__):
        again, _ = _qwz_graph(group_of_one)
    assert len(traces_made) == 2 and "ignoring an unreadable trace" in caplog.text
    assert torch.ops.zpp.gather_param.default not in [n.target for n in again.graph.nodes]


def _shifted(x: torch.Tensor, *, shift) -> torch.Tensor:
    return x + (shift if isinstance(shift, float) else 1.0)


def _inline(shift) -> None:
    graph = trace(lambda x: x + 1, torch.randn(4)).graph
    (x,) = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(x):
        graph_utils.inline_traced(graph, functools.partial(_shifted, shift=shift), [x])


def test_what_cannot_be_read_back_the_same_is_not_kept(trace_folder):
    _inline(object())  # an object in the arguments: its repr (an address) differs in every process
    assert not trace_folder.exists()
    with inductor_config.patch(fx_graph_cache=False):  # the user turned Inductor's caching off
        _inline(2.0)
    assert not trace_folder.exists()
    _inline(2.0)
    assert len(os.listdir(trace_folder)) == 1


def _views_and_new_tensors(x: torch.Tensor) -> tuple:
    flat = x.reshape(-1)  # a view of the input
    doubled = (flat * 2).view(4, -1)  # a view of a new tensor
    top, where = torch.max(doubled, dim=1)  # an op with two outputs
    return flat[2:], doubled.t(), top, where.float()


def _copied_values(inputs: list, fake_mode, copy_values) -> tuple[list, list]:
    """The fake values a copy of _views_and_new_tensors' trace (on inputs[0]) gets on inputs[1]
    from copy_values, input first, and the trace's own values."""
    traced = graph_utils._trace(_views_and_new_tensors, inputs[:1], fake_mode, None).graph
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = inputs[1]
    copied = {next(iter(traced.nodes)): x}
    graph.graph_copy(traced, copied)
    copy_values(list(traced.nodes), copied, fake_mode)
    computed = [n for n in traced.nodes if n.op == "call_function"]
    return [x.meta["val"]] + [copied[n].meta["val"] for n in computed], [n.meta["val"] for n in computed]


def _tensors(values: list) -> list:
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v])]


def _storage_classes(tensors: list) -> list[int]:
    """For each tensor, the index of the first tensor that shares its storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    keys = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    return [keys.index(k) for k in keys]


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad


def test_a_reused_trace_gets_new_values_related_as_running_its_ops_relates_them():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def run_ops(traced, copied, fake_mode):
        trace_cache.run_on_fake_values([copied[n] for n in traced if n.op == "call_function"], fake_mode)

    with FakeTensorMode() as fake_mode:
        inputs = [torch.empty(4, 6), torch.empty(4, 6)]
    expected, _ = _copied_values(inputs, fake_mode, run_ops)
    copied, traced = _copied_values(inputs, fake_mode, trace_cache.copy_fake_values)
    expected, copied, traced = _tensors(expected), _tensors(copied), _tensors(traced)
    assert [_geometry(t) for t in copied] == [_geometry(t) for t in expected]
    assert _storage_classes(copied) == _storage_classes(expected)
    assert _storage_classes(expected) != list(range(len(expected))), "the trace relates no two values"
    assert {id(t) for t in copied}.isdisjoint(id(t) for t in traced), "the trace's values were shared, not made"
    assert all(isinstance(t, FakeTensor) and t.fake_mode is fake_mode for t in copied)
