import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.passes import hierarchical_gather
from zpp_compile.topology import Topology

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional
TWO_NODES = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")


def _gathers_graph(group_size: int = 4, group: str = "world", shape=(10, 3)):
    """A parameter's part gathered over `group`, and a bucket of two gathered as the _out form."""

    def forward(part, bucket):
        whole = c10d.wait_tensor(c10d.all_gather_into_tensor(part, group_size, group))
        out = torch.empty(group_size * bucket.numel())
        merged = c10d.wait_tensor(c10d.all_gather_into_tensor_out(bucket, group_size, group, out=out))
        return whole * 2, merged.view(group_size, -1)[:, :5] + 1

    return trace(forward, torch.randn(*shape), torch.randn(8))


def _gathers(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]


def test_a_world_gather_becomes_one_across_nodes_then_one_in_the_node_in_world_order():
    gm = hierarchical_gather(_gathers_graph(), context(TWO_NODES, hierarchical_gather=True))
    assert c10d.all_gather_into_tensor_out.default not in targets(gm)
    assert torch.ops.aten.empty.memory_format not in targets(gm)  # the _out form's buffer went with it
    gathers = _gathers(gm)
    assert [(n.args[1], n.args[2]) for n in gathers] == [(2, "local_1"), (2, "node_0")] * 2
    # The in-node stage sends what the cross-node stage received: N parts.
    assert [tuple(n.args[0].meta["val"].shape) for n in gathers] == [(10, 3), (20, 3), (8,), (16,)]
    # World order from [local][node]: rank n*2 + l's part is the (l*2 + n)-th of the in-node result.
    cats = [n for n in gm.graph.nodes if n.target == torch.ops.aten.cat.default]
    starts = [[part.args[2] for part in cat.args[0]] for cat in cats]
    assert starts == [[0, 20, 10, 30], [0, 16, 8, 24]]
    whole, merged = gm.graph.output_node().args[0]
    assert (tuple(whole.meta["val"].shape), tuple(merged.meta["val"].shape)) == ((40, 3), (4, 5))


def test_gathers_over_other_groups_are_left_alone():
    gm = _gathers_graph(group_size=2, group="hpz_0")
    code = gm.code
    assert hierarchical_gather(gm, context(TWO_NODES, hierarchical_gather=True)).code == code


def test_one_node_or_one_rank_per_node_leaves_the_graph_unchanged():
    for topology in (
        Topology(4, 1, 4, "world", node_group_name="world"),
        Topology(4, 1, 1, "world", node_group_name="self_1", cross_node_group_name="world"),
    ):
        gm = _gathers_graph()
        code = gm.code
        assert hierarchical_gather(gm, context(topology, hierarchical_gather=True)).code == code


def test_graph_is_unchanged_when_off():
    gm = _gathers_graph()
    code = gm.code
    assert hierarchical_gather(gm, context(TWO_NODES)).code == code
