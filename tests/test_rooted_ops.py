"""zpp_compile/rooted_ops.py and passes/root_large_collectives.py: compiled graphs' large gathers and
reduce-scatters on gloo run as asynchronous per-owner collectives and give what the functional
collectives give."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile import rooted_ops
from zpp_compile.backend import clear_compiled_graphs, compiled_graphs
from zpp_compile.compat import all_gather_single, reduce_scatter_single
from zpp_compile.passes.graph_utils import c10d

from .models import loss_curve
from .test_eager_collectives import SLICE, assert_gathered_and_reduced_as_expected, rooted_from

zpp = torch.ops.zpp


def issued_then_waited() -> dict:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    shard = torch.arange(SLICE, dtype=torch.float32) + 1000 * rank
    flat = (rank + 1) * torch.arange(world * SLICE, dtype=torch.float32)
    expected_gather, expected_reduce = torch.empty(world * SLICE), torch.empty(SLICE)
    all_gather_single(expected_gather, shard, group=group)
    reduce_scatter_single(expected_reduce, flat.clone(), op=dist.ReduceOp.SUM, group=group)
    with rooted_from(0):
        # Both in flight at once, waited on in the other order: each wait completes its own works.
        reduced = zpp.rooted_reduce_scatter(flat, SLICE, world, group.group_name)
        gathered = zpp.rooted_all_gather(shard, world, group.group_name)
        in_flight = rooted_ops.in_flight_count()
        zpp.wait_rooted(gathered)
        zpp.wait_rooted(reduced, flat)
    try:
        zpp.wait_rooted(reduced)
        second_wait = ""
    except RuntimeError as error:
        second_wait = str(error)
    return {
        "gathered": gathered,
        "expected_gather": expected_gather,
        "reduced": reduced,
        "expected_reduce": expected_reduce,
        "in_flight": (in_flight, rooted_ops.in_flight_count()),
        "second_wait": second_wait,
    }


def test_rooted_ops_give_what_the_functional_collectives_give(pools):
    world = 4
    for rank, r in enumerate(pools(world).run(issued_then_waited)):
        assert_gathered_and_reduced_as_expected(r, rank, world)
        assert r["in_flight"] == (2, 0)
        assert "no rooted collective in flight" in r["second_wait"]


def short_flat_reduced(numel: int) -> dict:
    """The rooted reduce of a flat gradient that stops short of world x SLICE (its zero pad left
    off), against the functional reduce-scatter of the padded copy."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    flat = (rank + 1) * torch.arange(1, numel + 1, dtype=torch.float32)
    expected = torch.empty(SLICE)
    reduce_scatter_single(
        expected, torch.nn.functional.pad(flat, (0, world * SLICE - numel)), op=dist.ReduceOp.SUM, group=group
    )
    with rooted_from(0):
        reduced = zpp.rooted_reduce_scatter(flat, SLICE, world, group.group_name)
        zpp.wait_rooted(reduced, flat)
    try:
        zpp.rooted_reduce_scatter(torch.zeros(world * SLICE + 1), SLICE, world, group.group_name)
        too_long = ""
    except ValueError as error:
        too_long = str(error)
    return {"reduced": reduced, "expected": expected, "too_long": too_long}


# 4 ranks of SLICE (5): rank 2's part short by 2, rank 3's missing; rank 3's part short by 1.
@pytest.mark.parametrize("numel", [13, 19])
def test_a_flat_gradient_without_its_zero_pad_reduces_as_the_padded_one(pools, numel):
    for r in pools(4).run(short_flat_reduced, numel):
        assert torch.equal(r["reduced"], r["expected"])
        assert "21 elements do not fit 4 shards of 5" in r["too_long"]


# Compiled whole by Inductor; by region (the collectives then run as FX nodes); qwZ's int8 gathers
# and hpZ's in-node groups.
CONFIGS = {
    "whole": {"inductor_regions": False},
    "regions": {"inductor_regions": True},
    # One message per gradient, as a gradient above the bucket size travels (GPT-2's embedding).
    "regions_unbucketed": {"inductor_regions": True, "reduce_bucket_bytes": 0},
    "qwz_hpz": {"ranks_per_node": 2, "hpz_size": 2, "quantize_weights": True},
}


_LARGE_FUNCTIONAL = {
    str(op)
    for op in (
        c10d.reduce_scatter_tensor.default,
        c10d.all_gather_into_tensor.default,
        c10d.all_gather_into_tensor_out.default,
    )
}


def compiled_steps(name: str, config: str, rooted: bool, steps: int = 2) -> dict:
    """Compiled AdamW steps with every gather and reduce-scatter rooted (threshold 0) or none."""
    torch._dynamo.reset()
    clear_compiled_graphs()
    counter = zpp_compile.comm_counter()
    counter.reset()
    grads: list = []
    with rooted_from(0 if rooted else 1 << 62, piece_bytes=4096):
        losses, _ = loss_curve(zpp_compile.Config(**CONFIGS[config]), steps, lr=1e-2, grads=grads, model=name)
    graphs = [gm for record in compiled_graphs() for gm in (record.forward, record.backward) if gm is not None]
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    return {
        "losses": losses,
        "grads": grads,
        "bytes": counter.bytes(),
        "rooted_ops": sum(t.startswith("zpp.rooted_") for t in targets),
        "short_flats": sum(_reduces_a_short_flat(n) for gm in graphs for n in gm.graph.nodes),
        "functional": sum(t in _LARGE_FUNCTIONAL for t in targets),
        "in_flight": rooted_ops.in_flight_count(),
    }


def _reduces_a_short_flat(node: torch.fx.Node) -> bool:
    """A rooted reduce-scatter of a flat gradient without lower_reduce's zero pad."""
    if node.target is not torch.ops.zpp.rooted_reduce_scatter.default:
        return False
    flat, shard_numel, group_size = node.args[:3]
    return flat.meta["val"].numel() < shard_numel * group_size


@pytest.mark.parametrize(
    ("name", "config"),
    [("hf_gpt2", "whole"), ("hf_gpt2", "regions"), ("hf_gpt2_uneven", "regions_unbucketed"), ("gpt", "qwz_hpz")],
)
def test_compiled_training_with_every_collective_rooted_gives_the_same_results(pools, name, config):
    functional, rooted = (pools(4).run(compiled_steps, name, config, r) for r in (False, True))
    for rank in range(4):
        assert functional[rank]["rooted_ops"] == 0 and rooted[rank]["rooted_ops"] > 0
        # The padded tied embedding's gradient is written in place (fold_scatter_grads) and reduced
        # without its pad (root_large_collectives): the path a large tied vocabulary takes.
        assert (rooted[rank]["short_flats"] > 0) == (name == "hf_gpt2_uneven"), rooted[rank]["short_flats"]
        assert rooted[rank]["functional"] == 0, "a gather or reduce-scatter kept the functional form"
        assert rooted[rank]["in_flight"] == 0
        # The counter models the exchange, not gloo's algorithm: the same bytes either way.
        assert rooted[rank]["bytes"] == functional[rank]["bytes"]
        assert rooted[rank]["losses"] == pytest.approx(functional[rank]["losses"], rel=1e-6)
        for step, step_grads in enumerate(functional[rank]["grads"]):
            for i, grad in enumerate(step_grads):
                got = rooted[rank]["grads"][step][i]
                torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-7, msg=f"step {step} parameter {i}")
