import torch

import zpp_compile  # noqa: F401  (registers zpp:: ops)
from zpp_compile.codegen.int4 import chunk_payload_numel
from zpp_compile.config import Config
from zpp_compile.passes import PassContext, qgz
from zpp_compile.topology import Topology

from .helpers import targets, trace

c10d = torch.ops._c10d_functional


def _reduce_graph(group_name: str, world: int):
    def backward(grad):
        return torch.ops.zpp.reduce_grad(grad, 1000, world, group_name)

    return trace(backward, torch.randn(40, 25))


def _context(topology: Topology, **config) -> PassContext:
    config = Config(quantize_gradients=True, gradient_block_size=64, **config)
    return PassContext(config=config, topology=topology, graph_id=0, phase="backward")


def test_two_nodes_get_an_int4_all_to_all_in_the_node_then_one_across():
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
    gm = qgz(_reduce_graph("world", 4), _context(topology))
    assert torch.ops.zpp.reduce_grad.default not in targets(gm)
    all_to_alls = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert [n.args[-1] for n in all_to_alls] == ["node_0", "local_1"]
    payload = chunk_payload_numel(256, 64)  # shard 250 -> one chunk of 4 blocks of 64
    assert [n.args[0].meta["val"].numel() for n in all_to_alls] == [2 * 2 * payload, 2 * payload]
    assert {n.args[0].meta["val"].dtype for n in all_to_alls} == {torch.uint8}
    (result,) = gm.graph.output_node().args
    assert result.meta["val"].shape == (250,)


def test_error_feedback_adds_a_load_and_a_store_per_stage():
    topology = Topology(4, 1, 2, "world", node_group_name="node_0", cross_node_group_name="local_1")
    gm = qgz(_reduce_graph("world", 4), _context(topology, qgz_error_feedback=True))
    assert targets(gm).count(torch.ops.zpp.ef_load.default) == 2
    assert targets(gm).count(torch.ops.zpp.ef_store.default) == 2


def test_one_rank_per_node_skips_the_in_node_stage():
    topology = Topology(4, 1, 1, "world", node_group_name="self_1", cross_node_group_name="world")
    gm = qgz(_reduce_graph("world", 4), _context(topology))
    all_to_alls = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert [n.args[-1] for n in all_to_alls] == ["world"]  # quantized once, not twice


def test_a_world_of_one_gets_its_gradient_back_exactly(group_of_one):
    topology = Topology(1, 0, 1, group_of_one, node_group_name=group_of_one)
    gm = qgz(_reduce_graph(group_of_one, 1), _context(topology))
    assert c10d.all_to_all_single.default not in targets(gm)
    grad = torch.randn(40, 25)
    assert torch.equal(gm(grad), grad.reshape(-1))


def test_graph_is_unchanged_when_quantize_gradients_is_off(group_of_one):
    gm = _reduce_graph(group_of_one, 1)
    code = gm.code
    ctx = PassContext(config=Config(), topology=Topology(1, 0, 1, group_of_one), graph_id=0, phase="backward")
    assert qgz(gm, ctx).code == code
