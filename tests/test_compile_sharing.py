"""compile_sharing: the ranks of one host that share an Inductor cache compile each distinct region
once between them (real gloo ranks, real Inductor, real file locks, fresh cache directories)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch.fx.experimental.proxy_tensor import make_fx

import zpp_compile
from zpp_compile import compile_sharing
from zpp_compile.inductor_regions import RegionCompile

from .workers import reset_process_state

# Given, not measured: the scheduling passes place collectives by the rates, so rates measured
# afresh for each cache folder can cut a graph into a different number of regions.
RATES = dict(intra_node_gbps=10.0, inter_node_gbps=10.0, compute_tflops=0.1)


def _region(digest: str, scale: float) -> RegionCompile:
    x = torch.randn(8)
    gm = make_fx(lambda x: (torch.tanh(x) * scale,))(x)
    return RegionCompile(digest, len(gm.graph.nodes), gm, [x], compile_fx_inner)


def _hold_lock(path: str) -> subprocess.Popen:
    """Another process holding the file lock at `path` until its stdin closes (a rank compiling)."""
    code = textwrap.dedent(f"""
        import sys
        from filelock import FileLock
        lock = FileLock({path!r})
        lock.acquire()
        print("held", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_region_another_process_is_compiling_waits_and_the_others_go_first(tmp_path):
    """A region whose lock another process holds is compiled after the others, once that process
    lets go (here: when the last other region is compiled)."""
    order: list[str] = []
    jobs = [_region("first", 2.0), _region("busy", 3.0), _region("last", 4.0)]  # sizes equal
    with temporary_cache_dir(str(tmp_path)):
        os.makedirs(compile_sharing.lock_folder(), exist_ok=True)
        holder = _hold_lock(os.path.join(compile_sharing.lock_folder(), "busy.lock"))
        for job in jobs:
            job.compile = functools.partial(_compile_noting, job.compile, job.digest, order, holder)
        waited = compile_sharing.counts()["from_peers"]
        try:
            compile_sharing.run_compiles(jobs, timeout_s=60)
        finally:
            holder.kill()
    assert order == ["first", "last", "busy"], order
    assert compile_sharing.counts()["from_peers"] == waited + 1
    x = torch.randn(8)
    for job, scale in zip(jobs, (2.0, 3.0, 4.0)):
        torch.testing.assert_close(job.compiled([x]), (torch.tanh(x) * scale,))


def _compile_noting(compile_one, name: str, order: list[str], holder: subprocess.Popen) -> None:
    order.append(name)
    compile_one()
    if name == "last":  # the other process is done with "busy"
        holder.stdin.close()
        holder.wait()


def _first_step(cache: str, share: bool, by_region: bool = True) -> dict:
    """One forward and backward of HF GPT-2 (ZeRO-3, compiled by region or whole) in the Inductor
    cache `cache` ({rank} is this rank): the loss and compile_sharing.counts()."""
    import torch.distributed as dist

    from .models import batch, build, loss_of

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        with temporary_cache_dir(cache.format(rank=rank)):
            torch.manual_seed(0)
            config = zpp_compile.Config(inductor_regions=by_region, share_compiles=share, **RATES)
            model = zpp_compile.shard(build("hf_gpt2"), config)
            x, _ = batch("hf_gpt2", 2 * world, 0)
            x = x.chunk(world)[rank].clone()  # a view would have a rank's own storage offset
            loss = loss_of("hf_gpt2", torch.compile(model, backend="zeropp"), x, None)
            loss.backward()
            return {"loss": loss.item(), **compile_sharing.counts()}
    finally:
        reset_process_state()


@pytest.mark.parametrize("by_region", [True, False], ids=["regions", "whole_graphs"])
def test_ranks_sharing_a_cache_compile_each_region_once_between_them(pools, tmp_path, by_region):
    """Two ranks, each alone in its cache, miss every region (or whole graph: the forward and the
    backward); two ranks in one cache miss each once between them (what one compiled is a hit for
    the other), and train the same."""
    alone = pools(2).run(_first_step, os.path.join(tmp_path, "rank{rank}"), True, by_region)
    shared = pools(2).run(_first_step, os.path.join(tmp_path, "shared"), True, by_region)
    regions = alone[0]["misses"]
    assert regions > 4 if by_region else regions == 2, alone
    assert all(r["misses"] == r["compiled"] == regions for r in alone), alone
    assert sum(r["misses"] for r in shared) == regions, shared  # once between them (unshared: 2 x regions)
    assert all(r["compiled"] + r["from_peers"] == regions for r in shared), shared
    assert all(r["peer_misses"] == 0 for r in shared), shared
    assert [r["loss"] for r in shared] == [r["loss"] for r in alone]
