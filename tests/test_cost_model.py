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
