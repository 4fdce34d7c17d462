"""Scheduling passes: step time and peak memory of the GPT example with and without each of them.

    python benchmarks/scheduling.py [--nproc 4] [--ranks-per-node 2] [--steps 15]

Builds one model per config in the same processes (same seed, same data), compiles each with the
zeropp backend, warms each up, then times the configs' steps round-robin, so that the machine's
noise hits every config alike and the ratios come from one run. Per config, rank 0 reports the
median step time (and its ratio to the unscheduled run), the step peak (the most bytes allocated
during one step over what was live before it, torch.profiler), the most bytes of collective
buffers (gathered weights/buckets, gradients in reduction) alive at once in its compiled graphs
(zpp_compile.peak_collective_bytes), and collectives issued per step.
Prints markdown and writes docs/scheduling.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import benchmark_parser, publish, run_workers, step_peak_bytes, tracked  # noqa: E402

OFF = {"gather_bucket_bytes": 0, "reduce_bucket_bytes": 0, "prefetch_limit": 0}
ZERO_PP = {"quantize_weights": True, "hpz_size": 2, "quantize_gradients": True}
CONFIGS = {
    "ZeRO-3, no scheduling passes": OFF,
    "ZeRO-3, bucketing only": {"prefetch_limit": 0},
    "ZeRO-3, prefetch only": {"gather_bucket_bytes": 0, "reduce_bucket_bytes": 0},
    "ZeRO-3, bucketing + prefetch (default)": {},
    "ZeRO-3, 4 MiB buckets + prefetch": {"gather_bucket_bytes": 4 * 2**20, "reduce_bucket_bytes": 4 * 2**20},
    "qwZ+hpZ+qgZ, no scheduling passes": {**ZERO_PP, **OFF},
    "qwZ+hpZ+qgZ, bucketing + prefetch (default)": ZERO_PP,
}


def build(label: str, options: dict, args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    import zpp_compile
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    zpp_compile.shard(model, zpp_compile.Config(ranks_per_node=args.ranks_per_node, **options))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zeropp")
    tokens = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        compiled(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    return {"label": label, "step": step, "param_bytes": param_bytes}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import zpp_compile

    dist.init_process_group("gloo")
    runs = [build(label, options, args) for label, options in CONFIGS.items()]
    counter = zpp_compile.comm_counter()
    for run in tracked(runs, "first steps (compile)"):
        known = len(zpp_compile.compiled_graphs())
        start = time.perf_counter()
        run["step"]()
        run["first_step_s"] = time.perf_counter() - start
        graphs = [g for r in zpp_compile.compiled_graphs()[known:] for g in (r.forward, r.backward) if g is not None]
        run["graph_peak"] = max(zpp_compile.peak_collective_bytes(g) for g in graphs)
        run["step"]()
        counter.reset()
        run["peak"] = step_peak_bytes(run["step"])
        run["calls"] = counter.calls()
        run["times"] = []
    for _ in tracked(range(args.steps), "timed steps, every config"):
        for run in runs:
            dist.barrier()
            start = time.perf_counter()
            run["step"]()
            run["times"].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        keep = ("label", "param_bytes", "first_step_s", "peak", "graph_peak", "calls", "times")
        Path(args.out).write_text(json.dumps([{k: r[k] for k in keep} for r in runs]))
    dist.destroy_process_group()


def table(results: list[dict], args: argparse.Namespace) -> str:
    mb = 2**20
    m = results[0]["param_bytes"]
    medians = [statistics.median(r["times"]) * 1e3 for r in results]
    baseline = {
        r["label"].split(",")[0]: m for r, m in zip(results, medians) if r["label"].endswith("no scheduling passes")
    }
    lines = [
        f"`python benchmarks/scheduling.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--steps {args.steps}` (GPT {m / 4e6:.2f}M params, M = {m / mb:.1f} MB fp32, M/W = "
        f"{m / args.nproc / mb:.2f} MB per rank; world {args.nproc}, {args.nproc // args.ranks_per_node} "
        "simulated nodes, gloo, 2 CPU cores; rank 0; steps timed round-robin across configs)",
        "",
        "| config | median step ms | vs no scheduling | step peak MB | collective buffers live at once MB | collectives per step | first step s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, median in zip(results, medians):
        ratio = median / baseline[r["label"].split(",")[0]]
        lines.append(
            f"| {r['label']} | {median:.0f} | {ratio:.2f} | {r['peak'] / mb:.2f} | {r['graph_peak'] / mb:.2f} | "
            f"{r['calls']} | {r['first_step_s']:.1f} |"
        )
    lines += [
        "",
        "Step peak: the most bytes allocated during one step over what was live before it (persistent",
        "shards, gradients and Adam state excluded), from torch.profiler. Collective buffers live at once:",
        "zpp_compile.peak_collective_bytes over the config's compiled graphs, i.e. the gathered weights",
        "(or buckets) in use and in flight at the worst point of a graph, which is what bucket sizes and",
        "prefetch trade for speed. Collectives per step: from the communication counter.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = run_workers(
        __file__, args.nproc, ["--ranks-per-node", str(args.ranks_per_node), "--steps", str(args.steps)]
    )
    publish(table(results, args), "scheduling.md", "Scheduling passes: step time and memory")


if __name__ == "__main__":
    main()
