"""Compile time of the first training step: zeropp against torch.compile(DDP(model)), cold and warm.

    python benchmarks/compile_time.py [--nproc 4] [--ranks-per-node 2] [--layers 12,24]
        [--configs ddp,ddp_named_loss,zero3,zeropp_full] [--starts cold,warm,mega] [--width 768]
        [--repeats 1]

"ddp" is torch.compile(DistributedDataParallel(model)) as a new user writes it: GPT-2's loss logs
a warning under torch.compile, a graph break that makes Dynamo trace the model four times.
"ddp_named_loss" sets the model's loss_type first, which a DDP user can do to avoid that break
(shard() avoids it for zeropp, zpp_compile/hugging_face.py): the comparison of compile machinery
alone.
A zeropp config name with "_whole" appended (zero3_whole, zeropp_full_whole) keeps the biases and
norms whole on every rank (Config.keep_whole_numel=KEEP_WHOLE_NUMEL): graphs with a third of the
gathers.
"_unbatched" appended last (zeropp_full_unbatched) builds each C++ kernel as Inductor does, one
compiler run per kernel (Config.batch_cpu_kernels=False): the A/B of zpp_compile/cpu_kernel_batching.py.

Hugging Face GPT-2 built from a config (n_embd --width, --layers deep), 4 CPU processes as 2
simulated nodes x 2 (gloo). Each (config, depth) runs in fresh processes three ways:
  * cold: a new, empty TORCHINDUCTOR_CACHE_DIR;
  * warm: the same cache directory again, in new processes (a restarted job);
  * mega: a new, empty cache directory, after torch.compiler.load_cache_artifacts() of what the
    cold run saved with torch.compiler.save_cache_artifacts() (the portable "mega-cache").
Reported per run: the first step (forward, backward, AdamW step; compile included), a steady step,
peak RSS of rank 0 through the first step, Inductor FX-graph and AOTAutograd cache hits and misses,
and for zeropp the backend's seconds per stage (zpp_compile.compiled_graphs()[i].compile_seconds,
summed over graphs): AOTAutograd, each zeropp pass, the partitioner and Inductor. Writes
docs/compile_time.md.

--repeats N runs the whole set N times, round-robin (every config once, then again), because
one configuration's first step drifts by 10-20 s within an hour on a shared machine: a ratio to
DDP is taken within each repeat, and the table gives the median ratio with its range; the other
figures of a row are those of its median run.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import benchmark_parser, publish, run_workers, tracked  # noqa: E402

CONFIGS = ("ddp", "ddp_named_loss", "zero3", "zeropp_full")
KEEP_WHOLE_NUMEL = 10_000  # GPT-2's 1-d parameters (<= 4 x n_embd elements); its smallest matrix is n_embd^2
STARTS = ("cold", "warm", "mega")
SEQ, BATCH, VOCAB = 128, 2, 50257
# Stages shown as their own column; every other stage is summed into "zeropp passes".
STAGE_COLUMNS = {
    "aot_autograd": "AOTAutograd",
    "joint/inductor_joint_passes": "Inductor joint passes",
    "joint/min_cut_partition": "partitioner",
    "forward/inductor": "Inductor fwd",
    "backward/inductor": "Inductor bwd",
}


def _model(layers: int, width: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=VOCAB, n_positions=SEQ)
    return GPT2LMHeadModel(config)


def _build(name: str, layers: int, width: int, ranks_per_node: int):
    import torch

    if name.startswith("ddp"):
        model = _model(layers, width)
        if name == "ddp_named_loss":  # no logging graph break in the loss (zpp_compile/hugging_face.py)
            model.loss_type = "ForCausalLM"
        return torch.compile(torch.nn.parallel.DistributedDataParallel(model)), None
    import zpp_compile

    base = name.removesuffix("_unbatched")
    full = base.removesuffix("_whole") == "zeropp_full"
    with torch.device("meta"):
        model = _model(layers, width)
    config = zpp_compile.Config(
        ranks_per_node=ranks_per_node if full else None, quantize_weights=full, hpz_size=ranks_per_node if full else None,
        quantize_gradients=full, keep_whole_numel=KEEP_WHOLE_NUMEL if base.endswith("_whole") else 0,
        batch_cpu_kernels=not name.endswith("_unbatched"),
    )  # fmt: skip
    zpp_compile.shard(model, config)
    zpp_compile.materialize(model, init=lambda m: m.init_weights())
    return torch.compile(model, backend="zeropp"), model


def _cache_counters() -> dict:
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def _stage_seconds() -> dict:
    import zpp_compile

    stages: dict = defaultdict(float)
    for record in zpp_compile.compiled_graphs():
        for stage, seconds in record.compile_seconds.items():
            stages[stage] += seconds
    return dict(stages)


def measure(args: argparse.Namespace) -> dict:
    import torch

    rank = torch.distributed.get_rank()
    if args.load_artifacts:
        torch.compiler.load_cache_artifacts(base64.b64decode(Path(f"{args.load_artifacts}.{rank}").read_text()))
    torch.manual_seed(0)
    run, _ = _build(args.config, args.layers, args.width, args.ranks_per_node)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        start = time.perf_counter()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    first = step()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steady = min(step() for _ in range(2))
    if args.save_artifacts:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            Path(f"{args.save_artifacts}.{rank}").write_text(base64.b64encode(artifacts[0]).decode())
    return {"first_s": first, "steady_s": steady, "rss_mb": rss_mb, **_cache_counters(), "stages": _stage_seconds()}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    result = measure(args)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"rank0": result, "first_s_max": max(r["first_s"] for r in everyone)}))
    dist.destroy_process_group()


def run_starts(name: str, layers: int, args: argparse.Namespace, starts: list[str]) -> dict:
    """{start: result} for one (config, depth), each start in new processes."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cold_cache, artifacts = os.path.join(tmp, "cold"), os.path.join(tmp, "artifacts.b64")
        common = ["--config", name, "--layers", str(layers), "--width", str(args.width),
                  "--ranks-per-node", str(args.ranks_per_node)]  # fmt: skip
        plans = {
            "cold": (cold_cache, ["--save-artifacts", artifacts]),
            "warm": (cold_cache, []),
            "mega": (os.path.join(tmp, "mega"), ["--load-artifacts", artifacts]),
        }
        for start in ["cold", *(s for s in ("warm", "mega") if s in starts)]:  # the others reuse what cold left
            cache_dir, extra = plans[start]
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
            results[start] = run_workers(__file__, args.nproc, [*common, *extra])
    return {k: v for k, v in results.items() if k in starts}


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--layers", default="12,24", help="comma-separated depths")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--starts", default=",".join(STARTS))
    p.add_argument("--repeats", type=int, default=1, help="run every config this many times, round-robin")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--save-artifacts", help=argparse.SUPPRESS)
    p.add_argument("--load-artifacts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.layers = int(args.layers)
        return worker(args)
    starts = args.starts.split(",")
    runs = [(name, int(layers)) for layers in args.layers.split(",") for name in args.configs.split(",")]
    rows = []
    for repeat, name, layers in tracked(
        [(i, *run) for i in range(args.repeats) for run in runs], "repeats x configs x depths"
    ):
        for start, result in run_starts(name, layers, args, starts).items():
            rows.append({"config": name, "layers": layers, "start": start, "repeat": repeat, **result})
            print(json.dumps(rows[-1]), flush=True)
    publish(table(rows, args), "compile_time.md", "Compile time: the first training step")


def _key(row: dict) -> tuple:
    return row["config"], row["layers"], row["start"]


def _runs_by_key(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Every repeat's run of each (config, depth, start), in first-run order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_key(row), []).append(row)
    return groups


def _median_run(runs: list[dict]) -> dict:
    """The run with the median first step (the lower of the two middle ones for an even count)."""
    return sorted(runs, key=lambda r: r["first_s_max"])[(len(runs) - 1) // 2]


def _spread(values: list[float], fmt: str, unit: str = "") -> str:
    """The median, and with several values their range."""
    middle = format(statistics.median(values), fmt) + unit
    return middle if len(values) == 1 else f"{middle} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _ratio(groups: dict[tuple, list[dict]], runs: list[dict]) -> str:
    """Each run's first step over DDP's of the same repeat, depth and start: median (range)."""
    _, layers, start = _key(runs[0])
    ddp = {r["repeat"]: r["first_s_max"] for r in groups.get(("ddp", layers, start), [])}
    ratios = [r["first_s_max"] / ddp[r["repeat"]] for r in runs if r["repeat"] in ddp]
    return _spread(ratios, ".2f", "x") if ratios else "-"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    command = (f"`python benchmarks/compile_time.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
               f"--layers {args.layers} --width {args.width} --configs {args.configs} --starts {args.starts}"
               f"{f' --repeats {args.repeats}' if args.repeats > 1 else ''}`")  # fmt: skip
    repeated = (
        f" Medians of {args.repeats} round-robin repeats (range in brackets; a ratio is taken within each "
        "repeat); the other columns are the median run's."
        if args.repeats > 1
        else ""
    )
    lines = [
        f"{command} (HF GPT-2, n_embd {args.width}, {BATCH} x {SEQ} tokens per rank, AdamW, CPU, gloo; "
        f"{datetime.date.today()}).{repeated}",
        "",
        "| config | layers | start | first step s (slowest rank) | / DDP same start | steady step s | "
        "RSS rank 0 MB | FX graph cache hit/miss | AOT cache hit/miss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups = _runs_by_key(rows)
    medians = [_median_run(runs) for runs in groups.values()]
    for runs, row in zip(groups.values(), medians):
        r0 = row["rank0"]
        lines.append(
            f"| {row['config']} | {row['layers']} | {row['start']} | "
            f"{_spread([r['first_s_max'] for r in runs], '.1f')} | {_ratio(groups, runs)} | "
            f"{r0['steady_s']:.2f} | {r0['rss_mb']:.0f} | {r0['fxgraph_hit']}/{r0['fxgraph_miss']} | "
            f"{r0['aot_hit']}/{r0['aot_miss']} |"
        )
    lines += ["", *_stage_table(medians)]
    return "\n".join(lines)


def _stage_table(rows: list[dict]) -> list[str]:
    """Where zeropp's backend time goes (rank 0, summed over graphs); Dynamo and the step itself
    make up the rest of the first step."""
    headers = [*STAGE_COLUMNS.values(), "zeropp passes", "backend total", "rest of first step"]
    lines = [
        "Seconds per compile stage, rank 0, summed over graphs (zeropp runs; `compile_seconds` of "
        "`zpp_compile.compiled_graphs()`). \"rest of first step\" is Dynamo's tracing, guards and the step's compute.",
        "",
        "| config | layers | start | " + " | ".join(headers) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in headers) + " |",
    ]
    for row in rows:
        stages = row["rank0"]["stages"]
        if not stages:
            continue
        shown = [stages.get(k, 0.0) for k in STAGE_COLUMNS]
        passes = sum(v for k, v in stages.items() if k not in STAGE_COLUMNS)
        total = sum(stages.values())
        rest = row["rank0"]["first_s"] - total
        cells = " | ".join(f"{v:.1f}" for v in (*shown, passes, total, rest))
        lines.append(f"| {row['config']} | {row['layers']} | {row['start']} | {cells} |")
    for row in rows:  # the first run of each zeropp config
        if not row["rank0"]["stages"] or any(
            r is not row and r["config"] == row["config"] for r in rows[: rows.index(row)]
        ):
            continue
        passes = {k: v for k, v in row["rank0"]["stages"].items() if k not in STAGE_COLUMNS}
        slowest = sorted(passes.items(), key=lambda kv: -kv[1])[:6]
        listed = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in slowest)
        lines += ["", f"Slowest zeropp passes, {row['config']} {row['layers']} layers {row['start']}: {listed}"]
    return lines


if __name__ == "__main__":
    main()
