"""A rewritten graph survives pickling with its fake values (graph_pickling.py): views (whose
base's description torch leaves holding the process's fake mode), tensors sharing a storage
without being views, and module stacks naming classes made at run time (as shard() makes them)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zpp_compile import graph_pickling


def _graph_with_a_view() -> fx.GraphModule:
    """x @ relu(w) + w.view(-1)[:3], each node's fake value computed from its inputs' (as the
    passes' insert_call does): the view's value is a real view of w's."""
    aten = torch.ops.aten
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    flat = graph.call_function(aten.view.default, (w, [-1]))
    head = graph.call_function(aten.slice.Tensor, (flat, 0, 0, 3))
    out = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mm.default, (x, w)), head))
    copied = graph.call_function(aten.clone.default, (w,))
    bits = graph.call_function(aten.view.dtype, (copied, torch.int32))  # shares storage, not marked a view
    graph.output((out, bits))
    local_class = type("Linear", (torch.nn.Linear,), {})  # not findable by name, as shard()'s classes
    with FakeTensorMode() as mode:
        values = {x: mode.from_tensor(torch.ones(2, 3)), w: mode.from_tensor(torch.ones(3, 3))}
        for node in graph.nodes:
            if node.op == "call_function":
                values[node] = node.target(*(values.get(a, a) for a in node.args))
            if node in values:
                node.meta["val"] = values[node]
            node.meta["fwd_nn_module_stack"] = {"h.0": ("h.0", local_class)}
            node.meta["custom"] = {"zpp_param_input": 1}
    assert values[head]._is_view() and values[head]._base is values[w]
    return fx.GraphModule({}, graph)


def test_a_graph_with_views_and_run_time_classes_comes_back_with_its_fake_values():
    gm = _graph_with_a_view()
    data = graph_pickling.dumps(gm)
    loaded = graph_pickling.loads(data, FakeTensorMode())
    loaded.recompile()
    assert loaded.code == gm.code
    before = [(n.name, n.meta.get("val")) for n in gm.graph.nodes]
    after = [(n.name, n.meta.get("val")) for n in loaded.graph.nodes]
    for (name, want), (_, got) in zip(before, after):
        if isinstance(want, torch.Tensor):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), name
    value = {n.name: n.meta.get("val") for n in loaded.graph.nodes}
    assert value["view_dtype"].untyped_storage()._cdata == value["clone_default"].untyped_storage()._cdata
    head, w = loaded.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)[0], "w"
    assert head.meta["val"]._base is next(n for n in loaded.graph.nodes if n.name == w).meta["val"]
    assert all("fwd_nn_module_stack" not in n.meta for n in loaded.graph.nodes)
    assert all(n.meta["custom"] == {"zpp_param_input": 1} for n in loaded.graph.nodes)
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    assert all(torch.equal(a, b) for a, b in zip(loaded(x, w), gm(x, w)))
