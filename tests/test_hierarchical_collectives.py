"""Config.hierarchical_reduce and Config.hierarchical_gather: the two-stage collectives against the
exact average and against the world's collectives in training, with their bytes between nodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.passes.hierarchical_reduce import hierarchical_reduce_scatter
from zpp_compile.topology import build_topology

from .models import loss_curve
from .workers import reset_process_state

NUMELS = [1, 7, 1000, 4096, 5003]  # a scalar, tiny, shards that need padding, even, odd


def _rank_gradient(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64) * (1 + rank)


def max_error_over_bound(ranks_per_node: int, dtype: torch.dtype) -> float:
    """Reduce NUMELS' gradients (one bucket) hierarchically; max(|error| / bound) over every element.

    Bound per element: float rounding only. The result is rounded to `dtype` once, and (16-bit)
    each node's partial sum once on its way across; fp32 sums add a few ulps of the absolute sum.
    A chunk sent to the wrong rank, or a missing or doubled average, is off by the gradient itself.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = build_topology(zpp_compile.Config(ranks_per_node=ranks_per_node, hierarchical_reduce=True))
    shards = [-(-numel // world) for numel in NUMELS]
    mine = hierarchical_reduce_scatter(
        *(_rank_gradient(rank, n).to(dtype) for n in NUMELS), numels=NUMELS, shards=shards, topology=topology
    )
    worst = 0.0
    for numel, shard, got in zip(NUMELS, shards, mine):
        grads = torch.stack([_rank_gradient(r, numel).to(dtype).double() for r in range(world)])
        grads = torch.nn.functional.pad(grads, (0, world * shard - numel))[:, rank * shard : (rank + 1) * shard]
        exact = grads.sum(0) / world
        eps = torch.finfo(dtype).eps
        bound = eps * (exact.abs() + 2 * grads.abs().sum(0) / world) + world * torch.finfo(torch.float32).eps * (
            grads.abs().sum(0) / world
        )
        assert got.dtype == dtype and got.shape == (shard,)
        worst = max(worst, ((got.double() - exact).abs() / (bound + 1e-300)).max().item())
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "world,ranks_per_node", [(4, 2), (8, 4), (8, 2), (4, 4), (4, 1)], ids=["2x2", "2x4", "4x2", "1x4", "4x1"]
)
def test_reduced_shard_is_the_exact_average_within_float_rounding(pools, world, ranks_per_node, dtype):
    assert max(pools(world).run(max_error_over_bound, ranks_per_node, dtype)) <= 1


def _curve(config: zpp_compile.Config, steps: int, model: str) -> dict:
    counter = zpp_compile.comm_counter()
    counter.reset()
    grads: list = []
    losses, _ = loss_curve(config, steps, grads=grads, model=model)
    ops = ("all_to_all", "reduce_scatter", "all_gather")
    result = {
        "losses": losses,
        "grads": grads,
        "inter": {
            (phase, op): counter.bytes(phase=phase, locality="inter", op=op)
            for phase in ("forward", "backward")
            for op in ops
        },
        "calls": {op: counter.calls(phase="backward", op=op) / steps for op in ops[:2]},
    }
    reset_process_state()
    return result


def trained_twice(model: str, steps: int, config: dict, changed: dict, reference: dict) -> dict:
    """The same training on 2 nodes x 2 with `config` (and `reference`, e.g. its lowering) and
    with `changed` added to `config`."""
    config = zpp_compile.Config(ranks_per_node=2, **config)
    return {
        "before": _curve(dataclasses.replace(config, **reference), steps, model),
        "after": _curve(dataclasses.replace(config, **changed), steps, model),
    }


HIERARCHICAL = {"hierarchical_reduce": True, "hierarchical_gather": True}
AOT_EAGER = {"lowering": "aot_eager"}


def test_training_matches_the_world_collectives_with_half_the_bytes_between_nodes(pools):
    """HF GPT-2, both collectives hierarchical under Inductor, against the world's collectives
    run as FX graphs (the rounding of Inductor's kernels is within the tolerance)."""
    for result in pools(4).run(trained_twice, "hf_gpt2", 3, {}, HIERARCHICAL, AOT_EAGER):
        flat, hier = result["before"], result["after"]
        assert hier["calls"] == {"all_to_all": 2, "reduce_scatter": 0}  # one bucket: two all-to-alls
        assert flat["calls"]["all_to_all"] == 0
        # Counted (the logical model: a rank sends each peer its part): a rank sends its two peers
        # on the other node their shards flat, and one node sum of its chunk hierarchically; and
        # its part of a gather to both ranks of the other node, against to its counterpart only.
        assert 2 * hier["inter"]["backward", "all_to_all"] == flat["inter"]["backward", "reduce_scatter"] > 0
        assert 2 * hier["inter"]["forward", "all_gather"] == flat["inter"]["forward", "all_gather"] > 0
        # The backward regathers a few elements fewer under Inductor than as FX graphs (measured:
        # 32 fewer per step), so at most half here; a world gather left whole would send twice.
        assert 0 < 2 * hier["inter"]["backward", "all_gather"] <= flat["inter"]["backward", "all_gather"]
        assert hier["losses"] == pytest.approx(flat["losses"], rel=1e-5)
        for step_flat, step_hier in zip(flat["grads"], hier["grads"]):
            scale = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in step_flat]))
            for a, b in zip(step_flat, step_hier):
                assert (a - b).norm() <= 1e-5 * scale


def test_the_hierarchical_gather_of_int8_payloads_and_hpz_secondaries_is_bitwise_the_worlds(pools):
    """qwZ + hpZ on the tiny GPT (as FX graphs): the forward's int8 payloads travel in two stages,
    reordered into world order before they are dequantized and before hpZ keeps its slice;
    nothing else changes."""
    qwz_hpz = {"quantize_weights": True, "hpz_size": 2, **AOT_EAGER}
    for result in pools(4).run(trained_twice, "gpt", 3, qwz_hpz, {"hierarchical_gather": True}, {}):
        flat, hier = result["before"], result["after"]
        assert hier["losses"] == flat["losses"]
        for step_flat, step_hier in zip(flat["grads"], hier["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(step_flat, step_hier))
        assert 2 * hier["inter"]["forward", "all_gather"] == flat["inter"]["forward", "all_gather"] > 0
        assert hier["inter"]["backward", "all_gather"] == flat["inter"]["backward", "all_gather"] == 0  # hpZ
