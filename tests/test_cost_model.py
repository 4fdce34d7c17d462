"""The cost model's fixed costs: named defaults, overridable through Config (validated)."""

from __future__ import annotations

import pytest

import zpp_compile
from zpp_compile.config import DEFAULT_COLLECTIVE_LATENCY_US, DEFAULT_KERNEL_US
from zpp_compile.cost_model import CostModel, build_cost_model

RATES = dict(intra_node_gbps=80.0, inter_node_gbps=8.0, compute_tflops=1.0)  # given: nothing measured


def test_defaults_are_the_named_constants():
    model = build_cost_model(zpp_compile.Config(**RATES))
    assert (model.latency_s, model.kernel_s) == (DEFAULT_COLLECTIVE_LATENCY_US / 1e6, DEFAULT_KERNEL_US / 1e6)
    assert (model.latency_s, model.kernel_s) == (50e-6, 5e-6)  # the values the scheduling was tuned with
    bare = CostModel(intra_node_bytes_per_s=1.0, inter_node_bytes_per_s=1.0, flops_per_s=1.0)
    assert (bare.latency_s, bare.kernel_s) == (model.latency_s, model.kernel_s)


def test_config_overrides_latency_and_kernel_cost():
    model = build_cost_model(zpp_compile.Config(**RATES, collective_latency_us=120, kernel_us=0))
    assert model.latency_s == pytest.approx(120e-6) and model.kernel_s == 0
    # 1 MB across nodes at 8 Gbit/s: 1 ms, plus the latency.
    assert model.collective_seconds(10**6, crosses_nodes=True) == pytest.approx(120e-6 + 1e-3)


@pytest.mark.parametrize("name", ["collective_latency_us", "kernel_us"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "5"])
def test_config_refuses_bad_fixed_costs(name, value):
    with pytest.raises(ValueError, match=f"Config.{name}=.* must be a finite number >= 0"):
        zpp_compile.Config(**{name: value})


def _shard_with_nothing_remembered(folder: str) -> tuple[bool, bool]:
    """shard() on a cold cache folder (the rates are measured): (the default generator's state is
    as it was, a rates file was written)."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from zpp_compile import cost_model

    from .models import build

    saved = cost_model._rates_folder
    cost_model._rates_folder = lambda: Path(folder)
    try:
        model = build("gpt")
        before = torch.get_rng_state()
        zpp_compile.shard(model, zpp_compile.Config())
        untouched = torch.equal(torch.get_rng_state(), before)
        dist.barrier()  # only local rank 0 writes the file: the others look once it has
        return untouched, any(Path(folder).glob("rates-*.json"))
    finally:
        cost_model._rates_folder = saved
        zpp_compile.reset()


def test_measuring_the_rates_leaves_the_users_random_stream_alone(pools, tmp_path):
    # The model's initialization after shard() (meta init), dropout and data order draw from the
    # default generator: a probe drawing from it made a cold start train unlike its rerun.
    for rank, (untouched, measured) in enumerate(pools(2).run(_shard_with_nothing_remembered, str(tmp_path))):
        assert measured, "nothing was measured: the test did not exercise the probe"
        assert untouched, f"rank {rank}: shard() drew from the default random generator"
