"""qgZ convergence: the GPT example trained with and without int4 gradient reduction.

    python benchmarks/qgz_convergence.py [--nproc 4] [--ranks-per-node 2] [--steps 200]

Runs examples/train_gpt.py five times back to back (same seed, same data, simulated nodes):
Config(), Config(quantize_gradients=True), the same with qgz_error_feedback=True, and all of
ZeRO++ (qwZ + hpZ 2 + qgZ) without and with error feedback, and writes the loss curves to
docs/qgz_convergence.md (table every 20 steps, final validation loss, bytes per step) and, when
matplotlib is installed, docs/qgz_convergence.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import publish  # noqa: E402

ZERO_PP = ["--qwz", "--hpz", "2"]
RUNS = {"fp32 reduce-scatter": [], "qgZ (int4 all-to-all)": ["--qgz"], "qgZ + error feedback": ["--qgz-ef"],
        "qwZ+hpZ+qgZ": [*ZERO_PP, "--qgz"], "qwZ+hpZ+qgZ + error feedback": [*ZERO_PP, "--qgz-ef"]}  # fmt: skip
MODES = {"fp32 reduce-scatter": "compiled-inductor", "qgZ (int4 all-to-all)": "compiled-inductor+qgz",
         "qgZ + error feedback": "compiled-inductor+qgz-ef", "qwZ+hpZ+qgZ": "compiled-inductor+qwz+hpz2+qgz",
         "qwZ+hpZ+qgZ + error feedback": "compiled-inductor+qwz+hpz2+qgz-ef"}  # fmt: skip


def train(label: str, args: argparse.Namespace, out_dir: str, extra: Sequence[str] = ()) -> tuple[dict, list[float]]:
    """One run of examples/train_gpt.py with the flags of `label` (and `extra`): its JSON summary
    and its per-step training losses."""
    return train_with(RUNS[label], MODES[label], args, out_dir, extra)


def train_with(
    flags: Sequence[str], mode: str, args: argparse.Namespace, out_dir: str, extra: Sequence[str] = ()
) -> tuple[dict, list[float]]:
    """train() with the flags given, and the mode train_gpt.py names its outputs by for them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(ROOT / "examples" / "train_gpt.py"), "--steps", str(args.steps), "--out-dir", out_dir,
           "--ranks-per-node", str(args.ranks_per_node), *flags, *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    summary = json.loads((Path(out_dir) / f"train_gpt_{mode}.json").read_text())
    with open(Path(out_dir) / f"train_gpt_{mode}.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    return summary, losses


def plot(curves: dict[str, list[float]], path: Path, smooth: int = 1) -> bool:
    """The loss curves (each a running mean over `smooth` steps) as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        smoothed = [sum(losses[max(0, i - smooth + 1) : i + 1]) / len(losses[max(0, i - smooth + 1) : i + 1])
                    for i in range(len(losses))]  # fmt: skip
        ax.plot(range(1, len(losses) + 1), smoothed, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (world mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for label in RUNS:
            results[label] = train(label, args, out)
    labels = list(results)
    lines = [
        f"`python benchmarks/qgz_convergence.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--steps {args.steps}` (GPT {results[labels[0]][0]['params'] / 1e6:.2f}M params, "
        f"{args.nproc // args.ranks_per_node} simulated nodes x {args.ranks_per_node}, gloo, CPU)",
        "",
        "| step | " + " | ".join(labels) + " | " + " | ".join(f"gap, {label}" for label in labels[1:]) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " | " + " | ".join("---" for _ in labels[1:]) + " |",
    ]
    curves = {label: losses for label, (_, losses) in results.items()}
    for step in [1, *range(20, args.steps + 1, 20)]:
        row = [curves[label][step - 1] for label in labels]
        gaps = [f"{(v - row[0]) / row[0]:+.2%}" for v in row[1:]]
        lines.append(f"| {step} | " + " | ".join(f"{v:.4f}" for v in row) + " | " + " | ".join(gaps) + " |")
    lines += ["", "| run | final train loss / fp32's | validation loss | / fp32's | sent MB/rank/step | median step ms |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    base_train, base_val = curves[labels[0]][-1], results[labels[0]][0]["val_loss"]
    for label, (summary, losses) in results.items():
        lines.append(
            f"| {label} | {losses[-1] / base_train:.4f} | {summary['val_loss']:.4f} | "
            f"{summary['val_loss'] / base_val:.4f} | {summary['sent_mb_per_rank_step']:.2f} | "
            f"{summary['median_step_ms']:.0f} |"
        )
    if plot(curves, ROOT / "docs" / "qgz_convergence.png"):
        lines += ["", "![loss curves](qgz_convergence.png)"]
    publish("\n".join(lines), "qgz_convergence.md", "Convergence: qgZ, and qwZ+hpZ+qgZ, against fp32")


if __name__ == "__main__":
    main()
