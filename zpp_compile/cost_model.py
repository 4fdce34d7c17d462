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
restarted job takes the decisions it took before and its graphs hit the FX-graph cache; they travel
in torch.compiler.save_cache_artifacts() too (_carried_in_mega_cache), so a job started in a new
folder from that "mega-cache" takes them as well and hits AOTAutograd's cache, whose key holds them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from .compat import all_gather_single
from .config import DEFAULT_COLLECTIVE_LATENCY_US, DEFAULT_KERNEL_US, Config
from .topology import Topology

_PROBE_BYTES = 4 * 2**20
_PROBE_MATMUL = 512
# The copy that measures the memory rate: larger than a CPU's last-level cache (a 4 MB copy ran
# from cache at ~10x the rate Inductor's quantize kernels then got under load).
_MEMORY_PROBE_BYTES = 64 * 2**20
_PROBE_REPEATS = 3  # the best of a few timings: less noise from a busy machine
# A remembered rate stands while a new measurement is within this factor of it: one timing on a
# busy machine varies by 2x (measured: 41 and 92 GFLOP/s in two runs on 2 shared cores), while a
# different machine or network differs by more.
REMEMBERED_RATES_TOLERANCE = 4.0
# The rates are measured this many times more, keeping the best of each (load only slows a
# timing), before they are first remembered and before a new measurement past the tolerance
# replaces them. Why: on 2 busy cores twelve measurements of 4 ranks spread 3.7x in FLOP/s; one
# that fell past the tolerance made a restarted job recompile every graph (the likely cause of two
# cache tests that failed now and then in CI). Remembering the best makes a later slow measurement
# the likely departure, and that one is taken again.
_REMEASURE_ROUNDS = 3
# Measured quantities that are times (lower is better); the others are rates.
_TIMES = frozenset({"latency_s", "comm_cpu_s_per_byte"})

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CostModel:
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    flops_per_s: float
    latency_s: float = DEFAULT_COLLECTIVE_LATENCY_US / 1e6  # fixed cost of one collective
    kernel_s: float = DEFAULT_KERNEL_US / 1e6  # fixed cost of one compute kernel
    # Measured for Config(plan="auto") only (a copy, every rank at once): with it a node costs at
    # least the bytes it reads and writes / this rate (a roofline), so memory-bound work counts.
    memory_bytes_per_s: Optional[float] = None
    # Measured for Config(plan="auto") on CPU devices only: the compute time one byte this rank
    # sends displaces. gloo moves bytes with the cores that compute, so its copies add to the
    # step where a GPU's transfers would hide behind the compute (cpu_seconds_per_byte_sent).
    comm_cpu_s_per_byte: float = 0.0

    def comm_cpu_seconds(self, bytes_sent: int) -> float:
        """Compute time that sending (and receiving as much) `bytes_sent` takes from this rank."""
        return bytes_sent * self.comm_cpu_s_per_byte

    def collective_seconds(self, bytes_sent: int, crosses_nodes: bool) -> float:
        bandwidth = self.inter_node_bytes_per_s if crosses_nodes else self.intra_node_bytes_per_s
        return self.latency_s + bytes_sent / bandwidth

    def node_seconds(self, node: fx.Node) -> float:
        """Estimated run time of one compute node of a graph (0 for placeholders, views, outputs)."""
        if node.op != "call_function":
            return 0.0
        return self.kernel_s + max(self._flop_seconds(node), self._memory_seconds(node))

    def elementwise_seconds(self, numel: int) -> float:
        """One pass over `numel` fp32 values (read and write), at the measured memory rate, else
        at 10 FLOPs per value."""
        if self.memory_bytes_per_s:
            return numel * 8 / self.memory_bytes_per_s
        return numel * 10 / self.flops_per_s

    def _flop_seconds(self, node: fx.Node) -> float:
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if formula is None:
            return 0.0
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
            fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
        )
        try:
            flops = formula(*fake_args, out_val=node.meta.get("val"), **fake_kwargs)
        except Exception:  # a formula that does not take this overload's arguments: count a kernel
            return 0.0
        # Under dynamic shapes flops is symbolic: take its hint (the example input's value) rather
        # than compare the expression, which would install a guard and recompile on every
        # sequence length that flips a scheduling decision.
        return concrete(flops) / self.flops_per_s

    def _memory_seconds(self, node: fx.Node) -> float:
        if not self.memory_bytes_per_s or returns_alias(node):
            return 0.0
        values = [n.meta.get("val") for n in (node, *node.all_input_nodes)]
        moved = sum(concrete(v.numel()) * v.element_size() for v in values if isinstance(v, torch.Tensor))
        return moved / self.memory_bytes_per_s


def returns_alias(node: fx.Node) -> bool:
    """Whether the op returns a view of (an alias into) an input: its schema says so."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def build_cost_model(
    config: Config,
    group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    topology: Optional[Topology] = None,
) -> CostModel:
    """The Config's rates, with the missing ones measured here (collective: every rank calls it),
    on `device` (where the model trains: NCCL groups take CUDA tensors only). With `topology` and
    Config(plan="auto") on several nodes, the links are measured apart: an all-gather inside each
    node and one across nodes (every rank at once, so each gets its share of the node's link), and
    the fixed cost of a collective is measured too (a 4-byte all-gather on the slower link), unless
    Config.collective_latency_us differs from its default."""
    measured: dict[str, float] = {}
    if config.intra_node_gbps is None or config.inter_node_gbps is None or config.compute_tflops is None:
        device = device or torch.device("cpu")
        links = _link_groups(config, topology)
        measure = functools.partial(_measure, group, device, links, auto=config.auto_plan)
        measured = _remembered(measure, group, device, nodes=topology.num_nodes if links else 1, auto=config.auto_plan)
    return CostModel(
        intra_node_bytes_per_s=_given_or(config.intra_node_gbps, measured, "intra_bytes_per_s", "bytes_per_s"),
        inter_node_bytes_per_s=_given_or(config.inter_node_gbps, measured, "inter_bytes_per_s", "bytes_per_s"),
        flops_per_s=config.compute_tflops * 1e12 if config.compute_tflops else measured["flops_per_s"],
        latency_s=measured.get("latency_s", config.collective_latency_us / 1e6)
        if config.collective_latency_us == DEFAULT_COLLECTIVE_LATENCY_US
        else config.collective_latency_us / 1e6,
        kernel_s=config.kernel_us / 1e6,
        memory_bytes_per_s=measured.get("memory_bytes_per_s"),
        comm_cpu_s_per_byte=measured.get("comm_cpu_s_per_byte", 0.0),
    )


def _given_or(gbps: Optional[float], measured: dict[str, float], link: str, world: str) -> float:
    """A bandwidth in bytes/s: the Config's, else the link's own measurement, else the world's."""
    if gbps:
        return gbps * 1e9 / 8
    return measured.get(link, measured.get(world, 0.0))


def _link_groups(config: Config, topology: Optional[Topology]) -> Optional[tuple[str, str]]:
    """(node group, cross-node group) to measure the two links on, when they are worth telling
    apart: an automatic plan on several nodes of several ranks each."""
    if topology is None or not config.auto_plan or topology.num_nodes < 2 or topology.ranks_per_node < 2:
        return None
    if topology.node_group_name is None or topology.cross_node_group_name is None:
        return None
    return topology.node_group_name, topology.cross_node_group_name


def _measure(
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    links: Optional[tuple[str, str]] = None,
    auto: bool = False,
) -> dict[str, float]:
    """All-gather bytes/s per rank (of the world, or of each link) and matmul FLOP/s, and with
    `auto` a tiny all-gather's time and a copy's bytes/s, and on a CPU the compute time a byte
    sent displaces (cpu_seconds_per_byte_sent), each the slowest rank's, on every rank."""
    groups = {"bytes_per_s": group} if links is None else {
        "intra_bytes_per_s": resolve_group(links[0]), "inter_bytes_per_s": resolve_group(links[1]),
    }  # fmt: skip
    probes = [_all_gather_timing(g, device, _PROBE_BYTES) for g in groups.values()]
    seconds = [p.seconds for p in probes]
    if auto:  # an automatic plan also weighs bucket counts and memory-bound work
        seconds.append(max(_all_gather_timing(g, device, 4 * dist.get_world_size(g)).seconds for g in groups.values()))
        source = torch.ones(_MEMORY_PROBE_BYTES // 4, device=device)
        target = torch.empty_like(source)
        target.copy_(source)
        seconds.append(min(_timed(lambda: target.copy_(source), device) for _ in range(_PROBE_REPEATS)))
    # From a generator of its own: the default one is the user's (the model's initialization after
    # shard(), dropout, data order), and this probe runs only while no rates are remembered, so
    # drawing from it made a first run and its rerun train differently from the same seed.
    probe_generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(_PROBE_MATMUL, _PROBE_MATMUL, device=device, generator=probe_generator)
    a @ a
    matmul = min((_Timing.of(lambda: a @ a, device) for _ in range(_PROBE_REPEATS)), key=lambda t: t.seconds)
    seconds.append(matmul.seconds)
    cpu_per_byte = auto and device.type == "cpu"
    if cpu_per_byte:
        seconds.append(cpu_seconds_per_byte_sent(probes, matmul))
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    slowest = slowest.tolist()
    rates = {"comm_cpu_s_per_byte": slowest.pop()} if cpu_per_byte else {}
    rates.update({name: max(p.bytes_sent, 1) / t for name, p, t in zip(groups, probes, slowest)})
    if auto:
        rates["latency_s"] = slowest[-3]
        rates["memory_bytes_per_s"] = 2 * _MEMORY_PROBE_BYTES / slowest[-2]
    rates["flops_per_s"] = 2 * _PROBE_MATMUL**3 / slowest[-1]
    return rates


@dataclasses.dataclass(frozen=True)
class _Timing:
    """One timed run: wall seconds, this process's CPU seconds (every thread: gloo's too), and for
    a collective the bytes this rank sent in it."""

    seconds: float
    cpu_seconds: float
    bytes_sent: int = 0

    @staticmethod
    def of(work: Callable[[], object], device: torch.device, bytes_sent: int = 0) -> _Timing:
        cpu = time.process_time()
        seconds = _timed(work, device)
        return _Timing(seconds, time.process_time() - cpu, bytes_sent)


def cpu_seconds_per_byte_sent(collectives: list[_Timing], matmul: _Timing) -> float:
    """The compute time one byte sent displaces on a CPU: the collectives' CPU seconds per byte
    sent, scaled by the matmul's wall seconds per CPU second. Both ran with every rank at once, so
    the scale is how the ranks share the cores: 2 when 4 single-threaded ranks share 2 cores (a
    CPU second of gloo delays this rank's compute by 2), 1/4 when one rank computes on 4 threads
    (gloo's thread takes one of them)."""
    sent = sum(c.bytes_sent for c in collectives)
    cpu = sum(c.cpu_seconds for c in collectives)
    if sent == 0 or matmul.cpu_seconds <= 0:
        return 0.0
    return cpu / sent * matmul.seconds / matmul.cpu_seconds


def _all_gather_timing(group: Optional[dist.ProcessGroup], device: torch.device, size: int) -> _Timing:
    """The fastest of a few all-gathers of `size` bytes over `group`."""
    world = dist.get_world_size(group)
    probe = torch.zeros(max(size // 4 // max(world, 1), 1), device=device)
    out = torch.empty(probe.numel() * world, device=device)
    all_gather_single(out, probe, group=group)  # warm-up: connections, buffers
    sent = probe.numel() * 4 * (world - 1)
    timings = [
        _Timing.of(lambda: all_gather_single(out, probe, group=group), device, sent) for _ in range(_PROBE_REPEATS)
    ]
    return min(timings, key=lambda t: t.seconds)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _remembered(
    measure: Callable[[], dict[str, float]],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    nodes: int = 1,
    auto: bool = False,
) -> dict[str, float]:
    """The rates an earlier run on this machine measured, when `measure()` (collective: the same
    result on every rank) comes within REMEMBERED_RATES_TOLERANCE of them; else the new ones, which
    are then remembered. With nothing remembered, or a measurement out of tolerance, it is repeated
    (_REMEASURE_ROUNDS, keeping the best of each rate) first; a replacement is logged.

    Why: the scheduling passes place collectives by these rates, and a measurement differs a little
    from run to run; graphs placed differently miss Inductor's FX-graph cache, so a restarted job
    would recompile everything. The rates live next to that cache (rates_file()); every rank
    takes the smallest of what the ranks chose, so they agree even when their files differ.
    """
    measured = measure()
    path = rates_file(dist.get_world_size(group), device, nodes, auto)
    stored = _read_rates(path, measured.keys())
    taken = 1
    while taken <= _REMEASURE_ROUNDS and _on_any_rank(
        stored is None or not _within_tolerance(stored, measured), group, device
    ):
        measured = _best_of(measured, measure())
        taken += 1
    close = stored is not None and _within_tolerance(stored, measured)
    chosen = stored if close else measured
    agreed = torch.tensor([chosen[k] for k in measured], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    rates = dict(zip(measured, agreed.tolist()))
    if rates != stored and int(os.environ.get("LOCAL_RANK", dist.get_rank(group))) == 0:
        if stored is not None:
            log.warning(
                "zpp_compile: measured rates %s replace those remembered in %s, %s (the best of %d "
                "measurements was more than %gx off, or the ranks' files differed): graphs scheduled "
                "with the old rates compile again. Config(intra_node_gbps=, inter_node_gbps=, "
                "compute_tflops=) schedules by fixed rates instead.",
                _rounded(rates), path, _rounded(stored), taken, REMEMBERED_RATES_TOLERANCE,
            )  # fmt: skip
        write_json_atomically(path, rates)
    _carried_in_mega_cache(path, rates)
    return rates


def _within_tolerance(stored: dict[str, float], measured: dict[str, float]) -> bool:
    return all(
        1 / REMEMBERED_RATES_TOLERANCE <= stored[k] / m <= REMEMBERED_RATES_TOLERANCE for k, m in measured.items()
    )


def _best_of(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """Each quantity's better value: load only slows a timing, so the better is the nearer the truth."""
    return {k: (min if k in _TIMES else max)(v, second[k]) for k, v in first.items()}


def _on_any_rank(flag: bool, group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether `flag` holds on some rank (collective), so that every rank takes the same branch."""
    found = torch.tensor([float(flag)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())


def _rounded(rates: dict[str, float]) -> dict[str, str]:
    return {k: f"{v:.3g}" for k, v in rates.items()}


def _carried_in_mega_cache(path: Path, rates: dict[str, float]) -> None:
    """Record the rates file in torch.compiler.save_cache_artifacts()'s collection, as a file of
    the cache folder: load_cache_artifacts() writes it into the loading process's folder.

    Why torch's "autotune" artifact type: its entries are files under the cache folder with the
    key as their relative path, as ours is. A type of our own would have to be registered before
    load_cache_artifacts() runs, and without it torch rejects the whole mega-cache, its graphs too."""
    from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact
    from torch.compiler._cache import CacheArtifactManager

    key = str(path.relative_to(rates_folder().parent))
    CacheArtifactManager.record_artifact(AutotuneCacheArtifact.type(), key, rates)


def rates_file(world: int, device: torch.device, nodes: int = 1, auto: bool = False) -> Path:
    """Where measured rates are remembered: in Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR);
    an automatic plan's (more rates, per link) apart."""
    kind = (f"-nodes{nodes}" if nodes > 1 else "") + ("-auto" if auto else "")
    return rates_folder() / f"rates-world{world}{kind}-{device.type}.json"


def rates_folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "zpp_compile"


def _read_rates(path: Path, names) -> Optional[dict[str, float]]:
    try:
        data = json.loads(path.read_text())
        return {name: float(data[name]) for name in names}
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError):  # one rank raising would hang the rest
        return None


def write_json_atomically(path: Path, rates: dict) -> None:
    """Atomically (ranks of several nodes may share the folder); a folder we cannot write is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(rates, f)
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
