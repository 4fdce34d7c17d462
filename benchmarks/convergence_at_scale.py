"""Convergence at a less toy scale: full ZeRO++ against fp32 ZeRO-3 on a 10.7M-parameter GPT,
1000 steps, three seeds.

    python benchmarks/convergence_at_scale.py [--nproc 4] [--ranks-per-node 2] [--steps 1000] [--seeds 0,1,2]
    python benchmarks/convergence_at_scale.py --seeds 1 --configs "qwZ+hpZ;qgZ alone"   # a gap taken apart

Each seed trains examples/train_gpt.py (6 layers, 384 wide, 6 heads, byte-level stdlib text) once
per config on the same batches: fp32 ZeRO-3 (the reference), the same lowered by aot_eager (float
rounding only), qwZ + hpZ 2 + qgZ, and the same with qgZ error feedback (beta 0 and 0.8);
`--configs` picks others, such as each technique alone. Reports per config the final loss and the
mean of the last 100 steps' losses (mean and spread over the seeds), their gap to the reference's,
and the validation loss; writes
docs/convergence_at_scale.md and, with matplotlib, docs/convergence_at_scale.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import publish  # noqa: E402
from benchmarks.qgz_convergence import MODES, ROOT, RUNS, ZERO_PP, plot, train_with  # noqa: E402

NOISE_FLOOR = "fp32, FX graphs (rounding only)"
# label -> (train_gpt.py flags, the mode its outputs are named by). The second run is fp32 again,
# lowered by aot_eager instead of Inductor: the same training up to float rounding, whose gap to
# the first is what chaos alone makes of a perturbation that small.
CONFIGS = {
    "fp32 reduce-scatter": (RUNS["fp32 reduce-scatter"], MODES["fp32 reduce-scatter"]),
    NOISE_FLOOR: (["--lowering", "aot_eager"], "compiled-aot_eager"),
    **{label: (RUNS[label], MODES[label]) for label in ("qwZ+hpZ+qgZ", "qwZ+hpZ+qgZ + error feedback")},
    # LoCo's blend of the stored error (Config.qgz_error_beta; the default 0 feeds it all back).
    "qwZ+hpZ+qgZ + error feedback, beta 0.8": (
        [*RUNS["qwZ+hpZ+qgZ + error feedback"], "--qgz-error-beta", "0.8"],
        MODES["qwZ+hpZ+qgZ + error feedback"] + "+beta0.8",
    ),
}
REFERENCE = "fp32 reduce-scatter"
DEFAULT_LABELS = tuple(CONFIGS)
# Each technique of the full set alone, to take a gap apart (--configs).
CONFIGS |= {
    "qwZ+hpZ": (ZERO_PP, "compiled-inductor+qwz+hpz2"),
    "qgZ alone": (RUNS["qgZ (int4 all-to-all)"], MODES["qgZ (int4 all-to-all)"]),
}
MODEL = ["--n-layer", "6", "--n-embd", "384", "--n-head", "6"]
TAIL = 100  # the last steps averaged: one step's loss on 256 tokens is noisy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--val-batches", type=int, default=64, help="held-out batches per rank (64: 16K tokens)")
    p.add_argument("--configs", default=None,
                   help=f"separated by ';' (labels hold commas), any of: {'; '.join(CONFIGS)}. Default: the first "
                        f"{len(DEFAULT_LABELS)}; the reference ({REFERENCE}) always runs")  # fmt: skip
    args = p.parse_args()
    chosen = DEFAULT_LABELS if args.configs is None else [c.strip() for c in args.configs.split(";")]
    unknown = set(chosen) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    args.labels = [REFERENCE, *(label for label in chosen if label != REFERENCE)]  # the reference first
    return args


def run_all(args: argparse.Namespace) -> dict[str, dict[int, tuple[dict, list[float]]]]:
    """results[label][seed] = (summary, losses), seeds outermost so a cut-short run still compares."""
    results: dict[str, dict[int, tuple[dict, list[float]]]] = {label: {} for label in args.labels}
    extra = [*MODEL, "--batch-size", str(args.batch_size), "--block-size", str(args.block_size), "--lr",
             str(args.lr), "--log-every", str(args.steps), "--val-batches", str(args.val_batches)]  # fmt: skip
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label in results:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as out:
                results[label][seed] = train_with(*CONFIGS[label], args, out, [*extra, "--seed", str(seed)])
            summary, losses = results[label][seed]
            print(f"seed {seed}, {label}: final {losses[-1]:.4f}, last-{TAIL} mean "
                  f"{statistics.fmean(losses[-TAIL:]):.4f}, {time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    return results


def spread(values: list[float]) -> str:
    """mean ± sample standard deviation (the spread over seeds)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} ± {sd:.4f}"


def table(results: dict[str, dict[int, tuple[dict, list[float]]]], args: argparse.Namespace) -> list[str]:
    seeds = sorted(results[REFERENCE])
    params = results[REFERENCE][seeds[0]][0]["params"]
    lines = [
        f"`python benchmarks/convergence_at_scale.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--steps {args.steps} --seeds {args.seeds}{configs_flag(args)}` (GPT {params / 1e6:.1f}M params, "
        f"{args.nproc // args.ranks_per_node} simulated nodes x {args.ranks_per_node}, "
        f"{args.nproc * args.batch_size * args.block_size} tokens/step, AdamW lr {args.lr} with warmup and "
        f"cosine decay, validation on {args.nproc * args.val_batches * args.batch_size * args.block_size} "
        f"held-out tokens, gloo, CPU). Mean ± standard deviation over {len(seeds)} seeds. A gap is "
        "(config − fp32) / fp32 of the same seed: its mean over the seeds, then each seed's.",
        "",
        f"| config | final loss | mean of last {TAIL} | validation loss | gap, last {TAIL} | gap, validation | "
        "inter-node MB/rank/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    metrics = {
        "final": lambda summary, losses: losses[-1],
        "tail": lambda summary, losses: statistics.fmean(losses[-TAIL:]),
        "val": lambda summary, losses: summary["val_loss"],
    }
    per_seed = {
        label: {name: [metric(*results[label][s]) for s in seeds] for name, metric in metrics.items()}
        for label in results
    }
    base = per_seed[REFERENCE]
    for label in results:
        values = per_seed[label]
        inter = results[label][seeds[0]][0]["sent_inter_mb_per_rank_step"]
        lines.append(
            f"| {label} | {spread(values['final'])} | {spread(values['tail'])} | {spread(values['val'])} | "
            f"{gaps(values['tail'], base['tail'])} | {gaps(values['val'], base['val'])} | {inter:.2f} |"
        )
    return lines


def configs_flag(args: argparse.Namespace) -> str:
    return "" if args.configs is None else f' --configs "{args.configs}"'


def gaps(values: list[float], base: list[float]) -> str:
    """The mean relative gap over the seeds, then each seed's: "+0.63% (+0.04, +1.76, +0.10)"."""
    each = [(v - b) / b for v, b in zip(values, base)]
    return f"{statistics.fmean(each):+.2%} ({', '.join(f'{g * 100:+.2f}' for g in each)})"


def main() -> None:
    args = parse_args()
    results = run_all(args)
    lines = table(results, args)
    seed = sorted(results[REFERENCE])[0]
    curves = {label: results[label][seed][1] for label in results}
    if plot(curves, ROOT / "docs" / "convergence_at_scale.png", smooth=50):
        lines += ["", f"Training loss, seed {seed}, running mean over 50 steps:", "",
                  "![loss curves](convergence_at_scale.png)"]  # fmt: skip
    publish("\n".join(lines), "convergence_at_scale.md", "Convergence at 10M parameters, 1000 steps")


if __name__ == "__main__":
    main()
