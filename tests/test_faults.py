"""A rank that dies or stalls makes the others fail with a CollectiveError, on time, never a hang.

These tests start their own two processes instead of using the shared worker pool: a rank is
killed on purpose, and the pool would take that for a crash of its own.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

import pytest

COLLECTIVE_TIMEOUT_S = 5.0  # Config(collective_timeout_s): what the waiting rank must honour
PROCESS_GROUP_TIMEOUT_S = 300  # far longer: the Config's timeout, not the default group's, must act


def fault_worker(rank: int, store: str, fault: str, mode: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import zpp_compile

    from .models import batch, build, loss_of

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2, timeout=timeout)
    torch.manual_seed(0)
    config = zpp_compile.Config(lowering="aot_eager", collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    model = zpp_compile.shard(build("mlp"), config)
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    for step in range(4):
        if step == 2 and rank == 1:
            if fault == "dies":
                os._exit(17)
            time.sleep(10 * COLLECTIVE_TIMEOUT_S)  # stalls: never reaches the step's collectives in time
        x, y = batch("mlp", 4, step)
        started = time.monotonic()
        try:
            loss_of("mlp", run, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
        except Exception as error:
            results.put((rank, type(error).__name__, str(error), time.monotonic() - started, traceback.format_exc()))
            return
    results.put((rank, "no error", "", 0.0, ""))


def _first_failure(fault: str, mode: str) -> tuple[str, str, float]:
    """Run the two ranks; return rank 0's (error type, message, seconds from step start to error)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = f"file://{tempfile.mktemp(prefix='zpp_fault_store_')}"
    procs = [ctx.Process(target=fault_worker, args=(r, store, fault, mode, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                rank, kind, message, seconds, trace = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"rank 0 neither failed nor finished within 120 s after rank 1 {fault}: a hang")
            if rank == 0:
                return kind, message + "\n" + trace, seconds
    finally:
        for p in procs:
            p.kill()
            p.join()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault, mode", [("dies", "compiled"), ("dies", "eager"), ("stalls", "compiled")])
def test_a_dead_or_stalled_rank_fails_the_others_with_a_clear_error_in_time(fault, mode):
    kind, message, seconds = _first_failure(fault, mode)
    assert kind == "CollectiveError", message
    assert "another rank died, or did not reach the same collective" in message
    assert "a forward or generate() that only some ranks run (evaluation or samples under `if rank == 0:`)" in message
    assert f"Config(collective_timeout_s={COLLECTIVE_TIMEOUT_S:g})" in message
    assert ("compiled graph" if mode == "compiled" else "the eager") in message
    if fault == "dies":
        assert seconds < COLLECTIVE_TIMEOUT_S, f"a dead peer must fail its peers at once, took {seconds:.1f} s"
    else:
        assert COLLECTIVE_TIMEOUT_S - 1 <= seconds < 3 * COLLECTIVE_TIMEOUT_S, f"failed after {seconds:.1f} s"


def group_timeouts(config_timeout_s) -> set:
    import torch
    from torch.distributed.distributed_c10d import _resolve_process_group

    import zpp_compile
    from zpp_compile.sharding import sharded_state
    from zpp_compile.topology import group_timeout

    config = zpp_compile.Config(
        ranks_per_node=2, hpz_size=2, quantize_gradients=True, collective_timeout_s=config_timeout_s
    )
    topology = sharded_state(zpp_compile.shard(torch.nn.Linear(4, 4), config)).topology
    names = (
        topology.world_group_name,
        topology.hpz_group_name,
        topology.node_group_name,
        topology.cross_node_group_name,
    )
    return {group_timeout(_resolve_process_group(n)).total_seconds() for n in names}


@pytest.mark.parametrize("config_timeout_s", [None, 7.0])
def test_every_group_zpp_compile_creates_keeps_the_timeout_in_force(pools, config_timeout_s):
    from .workers import COLLECTIVE_TIMEOUT_S as POOL_PROCESS_GROUP_TIMEOUT_S

    expected = {config_timeout_s or POOL_PROCESS_GROUP_TIMEOUT_S}
    assert pools(4).run(group_timeouts, config_timeout_s) == [expected] * 4
