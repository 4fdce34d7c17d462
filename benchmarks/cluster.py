"""Two simulated nodes on one machine: network namespaces joined by a rate-limited veth link.

    sudo python benchmarks/cluster.py [--rates 100mbit,1gbit,none] [--steps 6]
    sudo python benchmarks/cluster.py --grad-accum --rates 100mbit   # K=4 accumulation, sync vs no_sync

Builds namespaces zpp_node0 and zpp_node1, joined by the veth pair zpp_veth0 <-> zpp_veth1
(10.77.0.1 and 10.77.0.2, addresses that exist only inside the namespaces), and limits both ends
with `tc qdisc ... tbf` (netem is not available in this kernel). Each namespace runs torchrun
--nnodes 2 with 2 ranks and GLOO_SOCKET_IFNAME set to its veth end: traffic between the two ranks
of a node stays inside its namespace, traffic between nodes crosses the link. The namespaces are
removed afterwards, also when a run fails or is interrupted. Needs root (ip netns, tc).

For each link rate, every config (zeropp ZeRO-3, + qwZ, + hpZ, + qgZ, all three; FSDP2 and DDP in
fp32 and with bf16 communication) trains the same GPT on the same data in the same processes,
timed round-robin. Per step the bytes that crossed the link are read from zpp_veth0's counters
(tx + rx), next to what the communication counter says crossed. Writes docs/benchmarks.md and,
with matplotlib, docs/benchmarks.png (step time against link rate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAMESPACES = ("zpp_node0", "zpp_node1")
VETHS = ("zpp_veth0", "zpp_veth1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
MASTER_PORT = 29571
BURST = "1mbit"  # what reached line rate with tbf on this machine


def _ip(*args: str, namespace: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return subprocess.run([*prefix, *args], check=check, capture_output=True, text=True)


def require_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit(
            "benchmarks/cluster.py builds network namespaces and shapes a veth link with tc, which "
            "needs root: run it with sudo (or as root in a container with CAP_NET_ADMIN)."
        )


def remove_cluster() -> None:
    """Delete both namespaces (their veth ends and qdiscs go with them); quiet if absent."""
    for namespace in NAMESPACES:
        _ip("ip", "netns", "del", namespace, check=False)


@contextlib.contextmanager
def two_node_cluster() -> Iterator[None]:
    """The two namespaces and the link between them, removed on exit, error or SIGTERM."""
    require_root()
    remove_cluster()  # left over from a run that was killed
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for namespace in NAMESPACES:
            _ip("ip", "netns", "add", namespace)
        _ip("ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
        for namespace, veth, address in zip(NAMESPACES, VETHS, ADDRESSES):
            _ip("ip", "link", "set", veth, "netns", namespace)
            _ip("ip", "addr", "add", f"{address}/24", "dev", veth, namespace=namespace)
            _ip("ip", "link", "set", veth, "up", namespace=namespace)
            _ip("ip", "link", "set", "lo", "up", namespace=namespace)
        yield
    finally:
        remove_cluster()
        signal.signal(signal.SIGTERM, previous)


def set_link_rate(rate: Optional[str]) -> None:
    """Limit both directions of the link to `rate` (tc syntax, e.g. "100mbit"); None: unshaped."""
    for namespace, veth in zip(NAMESPACES, VETHS):
        _ip("tc", "qdisc", "del", "dev", veth, "root", namespace=namespace, check=False)
        if rate is not None:
            _ip("tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate, "burst", BURST, "latency", "100ms",
                namespace=namespace)  # fmt: skip


def launch(node: int, worker: list[str], nproc_per_node: int, env: dict[str, str]) -> subprocess.Popen:
    """torchrun for one node inside its namespace, rendezvous at node 0's address; `env` is added."""
    cmd = ["ip", "netns", "exec", NAMESPACES[node], sys.executable, "-m", "torch.distributed.run",
           "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
           "--master-addr", ADDRESSES[0], "--master-port", str(MASTER_PORT), *worker]  # fmt: skip
    # A session of its own: the node's torchrun and its workers are killed as one process group.
    env = {**os.environ, **env, "GLOO_SOCKET_IFNAME": VETHS[node], "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def run_on_cluster(worker: list[str], nproc_per_node: int, timeout_s: float, env: dict[str, str]) -> None:
    """Run `worker` (a script and its arguments) as a 2-node job; raise if either node fails."""
    nodes = [launch(node, worker, nproc_per_node, env) for node in range(2)]
    try:
        codes = [p.wait(timeout=timeout_s) for p in nodes]
    finally:  # also on SIGTERM: two_node_cluster turns it into SystemExit
        for p in nodes:
            _kill_group(p)
    if any(codes):
        raise RuntimeError(f"a node failed (exit codes {codes}); see the output above")


def _kill_group(p: subprocess.Popen) -> None:
    """Kill a node's torchrun and every worker it started (they share its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def link_counters() -> tuple[int, int]:
    """Bytes node 0's end of the link has sent and received so far (call it in node 0's namespace)."""
    stats = Path("/sys/class/net") / VETHS[0] / "statistics"
    tx, rx = (int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes"))
    return tx, rx


def link_bytes() -> int:
    """Bytes that crossed the link so far, both directions (read on node 0's end: call it there)."""
    return sum(link_counters())


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ("100mbit", "1gbit", "500kbit": decimal units, as tc reads them) in bytes per second."""
    for unit, bits in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8
    raise ValueError(f"--rate {rate!r}: give a tc rate such as 100mbit or 1gbit (an unshaped link has no rate to fill)")


def measure_rates(
    rates: list[Optional[str]],
    steps: int,
    configs: Optional[str],
    timeout_s: float,
    grad_accum: bool = False,
    cache_per_rate: bool = False,
) -> dict:
    """{rate: the worker's results} for each link rate, on one cluster (`configs`: comma-separated
    names of cluster_worker.py's CONFIGS; None: all of them). `cache_per_rate`: a fresh Inductor
    cache folder for each rate, so that zpp_compile measures each link anew instead of keeping the
    rates it remembered there (cost_model.py) from a link within 4x of it."""
    results = {}
    with two_node_cluster(), tempfile.TemporaryDirectory() as tmp:
        env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}  # the first rate compiles cold
        for rate in rates:
            if cache_per_rate:
                env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor-{rate}")}
            set_link_rate(rate)
            out = os.path.join(tmp, f"{rate}.json")
            worker = [str(ROOT / "benchmarks" / "cluster_worker.py"), "--out", out, "--steps", str(steps)]
            worker += ["--configs", configs] if configs else []
            worker += ["--grad-accum"] if grad_accum else []
            run_on_cluster(worker, nproc_per_node=2, timeout_s=timeout_s, env=env)
            results[rate or "unshaped"] = json.loads(Path(out).read_text())
    return results


def table(results: dict, command: str) -> str:
    mb = 1e6
    lines = [
        f"`{command}` (GPT 3.3M params, 4 ranks = 2 namespaces x 2, gloo over a tbf-limited veth; medians "
        "of round-robin steps after warm-up; step time = slowest rank; link bytes = both directions of "
        "the veth, counted = the communication counter's inter-node bytes summed over ranks; first step s: "
        "with a cold Inductor cache in the first table (compile time), a warm one after)",
    ]
    for rate, configs in results.items():
        fsdp, ddp = configs.get("FSDP2 fp32"), configs.get("DDP fp32")
        lines += ["", f"### link {rate}", "",
                  "| config | step ms | vs FSDP2 fp32 | vs DDP fp32 | link MB/step | counted inter MB/step | first step s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in configs.items():
            vs = [f"{r['step_s'] / b['step_s']:.2f}" if b else "-" for b in (fsdp, ddp)]
            lines.append(
                f"| {name} | {r['step_s'] * 1e3:.0f} | {vs[0]} | {vs[1]} | {r['link_bytes'] / mb:.2f} | "
                f"{r['counted_inter_bytes'] / mb:.2f} | {r['first_step_s']:.1f} |"
            )
    lines += ["", *LINK_VS_COUNTER.split("\n")]
    return "\n".join(lines)


LINK_VS_COUNTER = """\
Link against counted bytes: the communication counter uses the logical ZeRO++ model (each rank
sends its shard to every peer; in a reduce-scatter, each peer its part). Gloo's algorithms route
differently, and the veth shows it: on 2 nodes x 2 its ring all-gather moves 3/4 of the logical
inter-node bytes, and its reduce-scatter 3/2 of them (what a ring all-reduce moves). That predicts
the link figures within the TCP/IP overhead (2-6%), e.g. zeropp + qwZ: 0.75 x 6.4 (int8 forward
gather) + 0.75 x 25.2 (backward gather) + 1.5 x 25.2 (reduce-scatter) = 61.5 MB against 64.6 MB
on the link. For ZeRO-3 the two deviations cancel. qgZ's all-to-alls go pairwise, as modelled."""


def accumulation_table(results: dict, command: str) -> str:
    """Gradient accumulation, K micro-batches per optimizer step: every backward reduces (sync)
    against zpp_compile.no_sync on the first K-1 (one reduction per step). Bytes per optimizer step,
    summed over the 4 ranks (the communication counter), and the veth's."""
    mb = 1e6
    lines = [
        f"`{command}` (the GPT above, 4 ranks = 2 namespaces x 2, K=4 micro-batches of 1 sequence per "
        "rank per optimizer step; medians of round-robin steps after warm-up; bytes per optimizer "
        "step summed over ranks (communication counter); 'gradient' = the backward's reductions only; "
        "link = both directions of the veth)",
    ]
    for rate, configs in results.items():
        lines += ["", f"### link {rate}", "",
                  "| config | step ms | inter MB | intra MB | gradient inter MB | gradient intra MB | link MB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in configs.items():
            lines.append(
                f"| {name} | {r['step_s'] * 1e3:.0f} | {r['counted_inter_bytes'] / mb:.2f} | "
                f"{r['counted_intra_bytes'] / mb:.2f} | {r['reduce_inter_bytes'] / mb:.2f} | "
                f"{r['reduce_intra_bytes'] / mb:.2f} | {r['link_bytes'] / mb:.2f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rates = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in next(iter(results.values())):
        ax.plot(rates, [results[r][name]["step_s"] * 1e3 for r in rates], marker="o", label=name, linewidth=1)
    ax.set_xlabel("inter-node link")
    ax.set_ylabel("median step ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit,none", help="tc rates, 'none' for an unshaped link")
    p.add_argument("--steps", type=int, default=6)
    # Not read from cluster_worker.py: the worker imports this module (link_bytes), not the reverse.
    p.add_argument("--configs", help="comma-separated names of cluster_worker.py's CONFIGS (default: all)")
    p.add_argument("--grad-accum", action="store_true",
                   help="instead: gradient accumulation (K=4) with and without zpp_compile.no_sync, plain and "
                        "qgZ (cluster_worker.py's ACCUMULATION_CONFIGS); prints its table, writes nothing")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600, help="seconds per link rate")
    args = p.parse_args()
    rates = [None if r == "none" else r for r in args.rates.split(",")]
    results = measure_rates(rates, args.steps, args.configs, args.timeout, grad_accum=args.grad_accum)
    command = f"sudo python benchmarks/cluster.py --rates {args.rates} --steps {args.steps}"
    if args.grad_accum:
        print(accumulation_table(results, command + " --grad-accum"))
        return
    text = table(results, command)
    if plot(results, ROOT / "docs" / "benchmarks.png"):
        text += "\n\n![step time against link rate](benchmarks.png)"
    print(text)
    (ROOT / "docs" / "benchmarks.md").write_text("# Two-node cluster: zeropp against FSDP2 and DDP\n\n" + text + "\n")


if __name__ == "__main__":
    main()
