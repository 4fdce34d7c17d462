"""A rewritten graph survives pickling with its fake values (graph_pickling.py): views (whose
base's description torch leaves holding the process's fake mode), tensors sharing a storage
without being views (also at an offset into it), and module stacks naming classes made at run
time (as shard() makes them). Every value of such a graph is made again directly, none through
torch's meta converter (the slow way, kept for symbolic shapes and subclasses)."""

from __future__ import annotations

import collections

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import _graph_pickler as graph_pickler
from torch.fx.immutable_collections import immutable_dict, immutable_list

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
    tail = graph.call_function(aten.slice.Tensor, (graph.call_function(aten.view.default, (copied, [-1])), 0, 5, 9))
    tail_bits = graph.call_function(aten.view.dtype, (tail, torch.int32))  # at an offset, not a view
    graph.output((out, bits, tail_bits))
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
    assert not values[tail_bits]._is_view() and values[tail_bits].storage_offset() == 5
    return fx.GraphModule({}, graph)


class _Spied(graph_pickling._TensorPickleData):
    """torch's way of pickling a fake value (full description, meta converter), noting each value."""

    described: list = []

    def __init__(self, describer, t):
        _Spied.described.append(t)
        super().__init__(describer, t)


def test_a_graph_with_views_and_run_time_classes_comes_back_with_its_fake_values(monkeypatch):
    described = _Spied.described = []
    monkeypatch.setattr(graph_pickling, "_TensorPickleData", _Spied)
    gm = _graph_with_a_view()
    data = graph_pickling.dumps(gm)
    assert described == []
    loaded = graph_pickling.loads(data, FakeTensorMode())
    assert loaded.code == gm.code  # made on first use (a _LazyGraphModule)
    before = [(n.name, n.meta.get("val")) for n in gm.graph.nodes]
    after = [(n.name, n.meta.get("val")) for n in loaded.graph.nodes]
    for (name, want), (_, got) in zip(before, after):
        if isinstance(want, torch.Tensor):
            got_geometry = (got.shape, got.stride(), got.storage_offset(), got.dtype, got.untyped_storage().nbytes())
            want_geometry = (
                want.shape,
                want.stride(),
                want.storage_offset(),
                want.dtype,
                want.untyped_storage().nbytes(),
            )
            assert got_geometry == want_geometry, name
    value = {n.name: n.meta.get("val") for n in loaded.graph.nodes}
    clone_storage = value["clone_default"].untyped_storage()._cdata
    assert value["view_dtype"].untyped_storage()._cdata == clone_storage
    assert value["view_dtype_1"].untyped_storage()._cdata == clone_storage
    assert value["view_dtype_1"].untyped_storage()._cdata != value["w"].untyped_storage()._cdata
    head, w = loaded.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)[0], "w"
    assert head.meta["val"]._base is next(n for n in loaded.graph.nodes if n.name == w).meta["val"]
    assert all("fwd_nn_module_stack" not in n.meta for n in loaded.graph.nodes)
    assert all(n.meta["custom"] == {"zpp_param_input": 1} for n in loaded.graph.nodes)
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    assert all(torch.equal(a, b) for a, b in zip(loaded(x, w), gm(x, w)))


def test_node_arguments_map_as_pytree_maps_them_but_keep_sizes():
    Point = collections.namedtuple("Point", "x y")
    Leaf = type("Leaf", (), {})
    node = Leaf()
    values = [
        (node, [node, 1, immutable_list([node])], {"a": node, "b": immutable_dict({"c": (node,)})}),
        slice(node, None, 2), Point(node, 3), collections.OrderedDict(k=[node]), "s", None,
    ]  # fmt: skip
    for value in values:
        with graph_pickler.patch_pytree_map_over_slice():
            want = pytree.tree_map_only(Leaf, lambda v: "mapped", value)
        got = graph_pickling._map_nodes(value, lambda v: "mapped", Leaf)
        assert got == want and type(got) is type(want), value
    # pytree makes a torch.Size a tuple; kept, the loaded graph's code stays the one compiled cold
    assert type(graph_pickling._map_nodes(torch.Size([2, 3]), str, Leaf)) is torch.Size


def test_a_node_record_has_the_fields_torchs_has():
    """_NodePickleData skips torch's __init__ (its pytree mapping is slow): the record must still
    hold what torch's holds, so torch's unpickling and a newer torch's fields are not missed."""
    gm = _graph_with_a_view()
    options = graph_pickler.Options(ops_filter=None, node_metadata_key_filter=graph_pickling._kept_metadata)
    for node in gm.graph.nodes:
        ours = graph_pickling._NodePickleData(node, collections.defaultdict(object), options)
        torchs = graph_pickler._NodePickleData(node, collections.defaultdict(object), options)
        assert vars(ours).keys() == vars(torchs).keys()
        assert (ours.name, ours.op, ours.type, ours.meta.keys()) == (
            torchs.name,
            torchs.op,
            torchs.type,
            torchs.meta.keys(),
        )
        assert type(ours.target) is type(torchs.target) and vars(ours.target) == vars(torchs.target)


def test_a_graph_edited_after_its_last_recompile_comes_back_as_edited():
    """dumps does not recompile first (torch's does): the loaded module's code is the edited
    graph's, not the stale code the module still held."""
    gm = _graph_with_a_view()
    stale_code = gm.code
    output = gm.graph.output_node()
    out, bits, tail_bits = output.args[0]
    with gm.graph.inserting_before(output):
        negated = gm.graph.call_function(torch.ops.aten.neg.default, (out,))
    output.args = ((negated, bits, tail_bits),)
    assert gm.code == stale_code  # not recompiled
    loaded = graph_pickling.loads(graph_pickling.dumps(gm), FakeTensorMode())
    assert loaded.code != stale_code and "neg" in loaded.code
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    gm.recompile()
    assert all(torch.equal(a, b) for a, b in zip(loaded(x, w), gm(x, w)))
