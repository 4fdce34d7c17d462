"""The cost model the scheduling passes decide with: how long a collective and a compute node take.

Collective time = latency + bytes this rank sends / bandwidth of the link it crosses, where the
bytes are those that really travel (int8/int4 payloads under qwZ/qgZ) and the link is the slower
one the group spans (inter-node when the group has members on two nodes). Compute time = FLOPs
(torch.utils.flop_counter's formulas: matmuls, convolutions, attention) / a FLOP rate, plus a fixed
per-kernel cost (all a kernel without a FLOP formula costs). The latency and the per-kernel cost are
Config.collective_latency_us and Config.kernel_us (config.py says where their defaults come from).
Rates come from the Config or are measured once, in shard(), and then reduced to the slowest
rank's value, so every rank holds the same model and the passes take the same decisions
(passes/README.md, invariant 1). Measured rates are remembered in Inductor's cache folder, so a
restarted job takes the decisions it took before and its graphs hit the FX-graph cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from .compat import all_gather_single
from .config import DEFAULT_COLLECTIVE_LATENCY_US, DEFAULT_KERNEL_US, Config

_PROBE_BYTES = 4 * 2**20
_PROBE_MATMUL = 512
_PROBE_REPEATS = 3  # the best of a few timings: less noise from a busy machine
# A remembered rate stands while a new measurement is within this factor of it: one timing on a
# busy machine varies by 2x (measured: 41 and 92 GFLOP/s in two runs on 2 shared cores), while a
# different machine or network differs by more.
REMEMBERED_RATES_TOLERANCE = 4.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    flops_per_s: float
    latency_s: float = DEFAULT_COLLECTIVE_LATENCY_US / 1e6  # fixed cost of one collective
    kernel_s: float = DEFAULT_KERNEL_US / 1e6  # fixed cost of one compute kernel

    def collective_seconds(self, bytes_sent: int, crosses_nodes: bool) -> float:
        bandwidth = self.inter_node_bytes_per_s if crosses_nodes else self.intra_node_bytes_per_s
        return self.latency_s + bytes_sent / bandwidth

    def node_seconds(self, node: fx.Node) -> float:
        """Estimated run time of one compute node of a graph (0 for placeholders, views, outputs)."""
        if node.op != "call_function":
            return 0.0
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if formula is None:
            return self.kernel_s
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
            fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
        )
        try:
            flops = formula(*fake_args, out_val=node.meta.get("val"), **fake_kwargs)
        except Exception:  # a formula that does not take this overload's arguments: count a kernel
            return self.kernel_s
        # Under dynamic shapes flops is symbolic: take its hint (the example input's value) rather
        # than compare the expression, which would install a guard and recompile on every
        # sequence length that flips a scheduling decision.
        return self.kernel_s + concrete(flops) / self.flops_per_s


def build_cost_model(
    config: Config, group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None
) -> CostModel:
    """The Config's rates, with the missing ones measured here (collective: every rank calls it),
    on `device` (where the model trains: NCCL groups take CUDA tensors only)."""
    measured = None
    if config.intra_node_gbps is None or config.inter_node_gbps is None or config.compute_tflops is None:
        device = device or torch.device("cpu")
        measured = _remembered(_measure(group, device), group, device)
    bandwidth = measured[0] if measured else 0.0
    return CostModel(
        intra_node_bytes_per_s=config.intra_node_gbps * 1e9 / 8 if config.intra_node_gbps else bandwidth,
        inter_node_bytes_per_s=config.inter_node_gbps * 1e9 / 8 if config.inter_node_gbps else bandwidth,
        flops_per_s=config.compute_tflops * 1e12 if config.compute_tflops else measured[1],
        latency_s=config.collective_latency_us / 1e6,
        kernel_s=config.kernel_us / 1e6,
    )


def _measure(group: Optional[dist.ProcessGroup], device: torch.device) -> tuple[float, float]:
    """(all-gather bytes/s per rank, matmul FLOP/s), each the slowest rank's, on every rank."""
    world = dist.get_world_size(group)
    probe = torch.zeros(_PROBE_BYTES // 4 // max(world, 1), device=device)
    out = torch.empty(probe.numel() * world, device=device)
    all_gather_single(out, probe, group=group)  # warm-up: connections, buffers
    seconds = [min(_timed(lambda: all_gather_single(out, probe, group=group), device) for _ in range(_PROBE_REPEATS))]
    a = torch.randn(_PROBE_MATMUL, _PROBE_MATMUL, device=device)
    a @ a
    seconds.append(min(_timed(lambda: a @ a, device) for _ in range(_PROBE_REPEATS)))
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    sent = probe.numel() * 4 * (world - 1)
    return max(sent, 1) / slowest[0].item(), 2 * _PROBE_MATMUL**3 / slowest[1].item()


def _remembered(
    measured: tuple[float, float], group: Optional[dist.ProcessGroup], device: torch.device
) -> tuple[float, float]:
    """The rates an earlier run on this machine measured, when the new measurement is within
    REMEMBERED_RATES_TOLERANCE of them; else the new ones, which are then remembered.

    Why: the scheduling passes place collectives by these rates, and a measurement differs a little
    from run to run; graphs placed differently miss Inductor's FX-graph cache, so a restarted job
    would recompile everything. The rates live next to that cache (rates_file()); every rank
    takes the smallest of what the ranks chose, so they agree even when their files differ.
    """
    path = rates_file(dist.get_world_size(group), device)
    stored = _read_rates(path)
    close = stored is not None and all(
        1 / REMEMBERED_RATES_TOLERANCE <= s / m <= REMEMBERED_RATES_TOLERANCE for s, m in zip(stored, measured)
    )
    agreed = torch.tensor(stored if close else measured, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    rates = (agreed[0].item(), agreed[1].item())
    if rates != stored and int(os.environ.get("LOCAL_RANK", dist.get_rank(group))) == 0:
        _write_rates(path, rates)
    return rates


def rates_file(world: int, device: torch.device) -> Path:
    """Where measured rates are remembered: in Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "zpp_compile" / f"rates-world{world}-{device.type}.json"


def _read_rates(path: Path) -> Optional[tuple[float, float]]:
    try:
        data = json.loads(path.read_text())
        return float(data["bytes_per_s"]), float(data["flops_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_rates(path: Path, rates: tuple[float, float]) -> None:
    """Atomically (ranks of several nodes may share the folder); a folder we cannot write is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"bytes_per_s": rates[0], "flops_per_s": rates[1]}, f)
        os.replace(f.name, path)
    except OSError:
        pass


def _timed(work, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def concrete(value: Union[int, torch.SymInt]) -> int:
    """A count without symbols, taken without guarding on it: a symbolic count's hint."""
    return optimization_hint(value) if isinstance(value, torch.SymInt) else value
