"""Convergence at a less toy scale: full ZeRO++ against fp32 ZeRO-3 on a 10.7M-parameter GPT,
1000 steps, three seeds.

    python benchmarks/convergence_at_scale.py [--nproc 4] [--ranks-per-node 2] [--steps 1000] [--seeds 0,1,2]

Each seed trains examples/train_gpt.py (6 layers, 384 wide, 6 heads, byte-level stdlib text) three
times on the same batches: fp32 ZeRO-3 (the reference), qwZ + hpZ 2 + qgZ, and the same with qgZ
error feedback. Reports per config the final loss and the mean of the last 100 steps' losses (mean
and spread over the seeds), their gap to the reference's, and the validation loss; writes
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
from benchmarks.qgz_convergence import ROOT, plot, train  # noqa: E402

LABELS = ("fp32 reduce-scatter", "qwZ+hpZ+qgZ", "qwZ+hpZ+qgZ + error feedback")
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
    return p.parse_args()


def run_all(args: argparse.Namespace) -> dict[str, dict[int, tuple[dict, list[float]]]]:
    """results[label][seed] = (summary, losses), seeds outermost so a cut-short run still compares."""
    results: dict[str, dict[int, tuple[dict, list[float]]]] = {label: {} for label in LABELS}
    extra = [*MODEL, "--batch-size", str(args.batch_size), "--block-size", str(args.block_size), "--lr",
             str(args.lr), "--log-every", str(args.steps)]  # fmt: skip
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label in LABELS:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as out:
                results[label][seed] = train(label, args, out, [*extra, "--seed", str(seed)])
            summary, losses = results[label][seed]
            print(f"seed {seed}, {label}: final {losses[-1]:.4f}, last-{TAIL} mean "
                  f"{statistics.fmean(losses[-TAIL:]):.4f}, {time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    return results


def spread(values: list[float]) -> str:
    """mean ± sample standard deviation (the spread over seeds)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} ± {sd:.4f}"


def table(results: dict[str, dict[int, tuple[dict, list[float]]]], args: argparse.Namespace) -> list[str]:
    seeds = sorted(results[LABELS[0]])
    base = results[LABELS[0]]
    params = base[seeds[0]][0]["params"]
    lines = [
        f"`python benchmarks/convergence_at_scale.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--steps {args.steps} --seeds {args.seeds}` (GPT {params / 1e6:.1f}M params, "
        f"{args.nproc // args.ranks_per_node} simulated nodes x {args.ranks_per_node}, "
        f"{args.nproc * args.batch_size * args.block_size} tokens/step, AdamW lr {args.lr} with warmup and "
        f"cosine decay, gloo, CPU). Mean ± standard deviation over {len(seeds)} seeds; a gap is "
        "(config − fp32) / fp32 of the same seed, then averaged over seeds.",
        "",
        f"| config | final loss | mean of last {TAIL} | gap, final | gap, last {TAIL} | validation loss | "
        "inter-node MB/rank/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in LABELS:
        runs = results[label]
        finals = [runs[s][1][-1] for s in seeds]
        tails = [statistics.fmean(runs[s][1][-TAIL:]) for s in seeds]
        gap_final = [(runs[s][1][-1] - base[s][1][-1]) / base[s][1][-1] for s in seeds]
        gap_tail = [(t - statistics.fmean(base[s][1][-TAIL:])) / statistics.fmean(base[s][1][-TAIL:])
                    for s, t in zip(seeds, tails)]  # fmt: skip
        val = [runs[s][0]["val_loss"] for s in seeds]
        inter = runs[seeds[0]][0]["sent_inter_mb_per_rank_step"]
        lines.append(f"| {label} | {spread(finals)} | {spread(tails)} | {statistics.fmean(gap_final):+.2%} | "
                     f"{statistics.fmean(gap_tail):+.2%} | {spread(val)} | {inter:.2f} |")  # fmt: skip
    return lines


def main() -> None:
    args = parse_args()
    results = run_all(args)
    lines = table(results, args)
    seed = sorted(results[LABELS[0]])[0]
    curves = {label: results[label][seed][1] for label in LABELS}
    if plot(curves, ROOT / "docs" / "convergence_at_scale.png", smooth=50):
        lines += ["", f"Training loss, seed {seed}, running mean over 50 steps:", "",
                  "![loss curves](convergence_at_scale.png)"]  # fmt: skip
    publish("\n".join(lines), "convergence_at_scale.md", "Convergence at 10M parameters, 1000 steps")


if __name__ == "__main__":
    main()
