import pytest
import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.passes import hierarchical_reduce
from zpp_compile.topology import Topology

from .helpers import context, targets, trace

c10d = torch.ops._c10d_functional
TWO_NODES = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")


def _context(topology: Topology, **config):
    return context(topology, phase="backward", hierarchical_reduce=True, **config)


def _reductions_graph(dtypes=(torch.float32,) * 3, world: int = 4):
    """Gradients of 4000, 1000 and 2000 values, reduced in this order over the world."""

    def backward(*grads):
        return [torch.ops.zpp.reduce_grad(g, g.numel(), g.numel() // world, world, "world") for g in grads]

    return trace(backward, *(torch.randn(n, dtype=d) for n, d in zip((4000, 1000, 2000), dtypes)))


def _all_to_alls(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]


def test_two_nodes_get_an_all_to_all_in_the_node_then_one_of_the_node_sums_across():
    gm = hierarchical_reduce(_reductions_graph(), _context(TWO_NODES))
    assert torch.ops.zpp.reduce_grad.default not in targets(gm)
    assert c10d.reduce_scatter_tensor.default not in targets(gm)
    in_node, across = _all_to_alls(gm)
    assert (in_node.args[-1], across.args[-1]) == ("node_0", "local_1")
    shards = 1000 + 250 + 500
    # In the node: every rank's whole bucket, unquantized; across: the node sums of this local
    # rank's two chunks, half of the in-node payload per rank of the node.
    assert [n.args[0].meta["val"].numel() for n in (in_node, across)] == [4 * shards, 2 * shards]
    assert {n.args[0].meta["val"].dtype for n in (in_node, across)} == {torch.float32}
    outputs = gm.graph.output_node().args[0]
    assert [o.meta["val"].shape for o in outputs] == [(1000,), (250,), (500,)]


def test_gradients_travel_in_their_dtype_and_come_back_in_it():
    dtypes = (torch.bfloat16,) * 3
    gm = hierarchical_reduce(_reductions_graph(dtypes), _context(TWO_NODES))
    assert {n.args[0].meta["val"].dtype for n in _all_to_alls(gm)} == {torch.bfloat16}
    assert {o.meta["val"].dtype for o in gm.graph.output_node().args[0]} == {torch.bfloat16}


@pytest.mark.parametrize("cap,expected", [(0, 3), (20000, 2), (28000, 1)])
def test_consecutive_gradients_share_all_to_alls_up_to_the_bucket_size(cap, expected):
    gm = hierarchical_reduce(_reductions_graph(), _context(TWO_NODES, reduce_bucket_bytes=cap))
    assert len(_all_to_alls(gm)) == 2 * expected


def test_one_rank_per_node_skips_the_in_node_stage():
    topology = Topology(4, 1, 1, "world", node_group_name="self_1", cross_node_group_name="world")
    gm = hierarchical_reduce(_reductions_graph(), _context(topology))
    assert [n.args[-1] for n in _all_to_alls(gm)] == ["world"]


def test_qgz_takes_the_reductions_when_both_are_set():
    gm = _reductions_graph()
    code = gm.code
    assert hierarchical_reduce(gm, _context(TWO_NODES, quantize_gradients=True)).code == code


def test_a_world_of_one_gets_its_gradients_back_exactly(group_of_one):
    topology = Topology(1, 0, 1, group_of_one, node_group_name=group_of_one)

    def backward(a, b):
        return [torch.ops.zpp.reduce_grad(g, g.numel(), g.numel(), 1, group_of_one) for g in (a, b)]

    gm = hierarchical_reduce(trace(backward, torch.randn(33), torch.randn(5, 7)), _context(topology))
    assert c10d.all_to_all_single.default not in targets(gm)
    a, b = torch.randn(33), torch.randn(5, 7)
    got = gm(a, b)
    assert torch.equal(got[0], a) and torch.equal(got[1], b.reshape(-1))


def test_graph_is_unchanged_when_off(group_of_one):
    gm = _reductions_graph()
    code = gm.code
    assert hierarchical_reduce(gm, context(TWO_NODES, phase="backward")).code == code
