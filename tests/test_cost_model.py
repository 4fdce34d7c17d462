"""The cost model's fixed costs: named defaults, overridable through Config (validated)."""

from __future__ import annotations

import pytest

import zpp_compile
from zpp_compile.config import DEFAULT_COLLECTIVE_LATENCY_US, DEFAULT_KERNEL_US
from zpp_compile.cost_model import CostModel, _Timing, build_cost_model, cpu_seconds_per_byte_sent

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

    saved = cost_model.rates_folder
    cost_model.rates_folder = lambda: Path(folder)
    try:
        model = build("gpt")
        before = torch.get_rng_state()
        zpp_compile.shard(model, zpp_compile.Config())
        untouched = torch.equal(torch.get_rng_state(), before)
        dist.barrier()  # only local rank 0 writes the file: the others look once it has
        return untouched, any(Path(folder).glob("rates-*.json"))
    finally:
        cost_model.rates_folder = saved
        zpp_compile.reset()


def test_measuring_the_rates_leaves_the_users_random_stream_alone(pools, tmp_path):
    # The model's initialization after shard() (meta init), dropout and data order draw from the
    # default generator: a probe drawing from it made a cold start train unlike its rerun.
    for rank, (untouched, measured) in enumerate(pools(2).run(_shard_with_nothing_remembered, str(tmp_path))):
        assert measured, "nothing was measured: the test did not exercise the probe"
        assert untouched, f"rank {rank}: shard() drew from the default random generator"


def test_a_byte_sent_displaces_its_cpu_time_scaled_by_how_the_ranks_share_the_cores():
    gathers = [_Timing(seconds=0.02, cpu_seconds=0.003, bytes_sent=3_000_000)] * 2  # 1 ns of CPU per byte
    # A single-threaded rank sharing a core with another: its compute's wall time is twice its CPU time.
    shared = _Timing(seconds=0.2, cpu_seconds=0.1)
    assert cpu_seconds_per_byte_sent(gathers, shared) == pytest.approx(2e-9)
    # A rank computing on 4 threads of its own: gloo's thread takes a quarter of its compute.
    threads = _Timing(seconds=0.1, cpu_seconds=0.4)
    assert cpu_seconds_per_byte_sent(gathers, threads) == pytest.approx(0.25e-9)


def measured_comm_cpu() -> tuple[float, float]:
    """(compute seconds per byte sent measured for an automatic plan, and for a manual one)."""
    import tempfile
    from pathlib import Path

    from zpp_compile import cost_model

    saved = cost_model.rates_folder
    with tempfile.TemporaryDirectory() as folder:
        cost_model.rates_folder = lambda: Path(folder)  # nothing remembered: measured here
        try:
            auto = build_cost_model(zpp_compile.Config(plan="auto"))
            manual = build_cost_model(zpp_compile.Config())
        finally:
            cost_model.rates_folder = saved
    return auto.comm_cpu_s_per_byte, manual.comm_cpu_s_per_byte


def test_an_automatic_plan_on_cpus_measures_the_compute_a_byte_sent_costs_alike_on_every_rank(pools):
    results = pools(2).run(measured_comm_cpu)
    assert results[0] == results[1], results  # the slowest rank's, everywhere
    auto, manual = results[0]
    # gloo copies every byte at least once through the CPU; a copy runs at no more than ~100 GB/s
    # here, and nothing is that slow per byte that a 4 MiB gather would take seconds.
    assert 1e-11 < auto < 1e-6, auto
    assert manual == 0.0  # the scheduling passes do not use it: not measured
