"""Step time, compile time and bytes per step of examples/train_gpt.py, compiled vs eager.

    python benchmarks/step_time.py [--nproc 4] [--steps 40]

Both runs happen back to back on the same machine; compare their ratio, not absolute times
(shared machines are noisy). Prints a markdown table and writes it to docs/step_time.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(mode_args: list[str], nproc: int, steps: int, out_dir: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "examples" / "train_gpt.py"),
        "--steps",
        str(steps),
        "--out-dir",
        out_dir,
        *mode_args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    mode = "eager" if "--eager" in mode_args else "compiled-inductor"
    return json.loads((Path(out_dir) / f"train_gpt_{mode}.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        results = [run([], args.nproc, args.steps, out), run(["--eager"], args.nproc, args.steps, out)]
    compiled, eager = results
    lines = [
        f"`python benchmarks/step_time.py --nproc {args.nproc} --steps {args.steps}` "
        f"(GPT {compiled['params'] / 1e6:.2f}M params, world {compiled['world_size']}, gloo, CPU)",
        "",
        "| mode | first step (compile) s | median step ms | sent MB/rank/step | loss at last step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['first_step_s']:.1f} | {r['median_step_ms']:.0f} | "
            f"{r['sent_mb_per_rank_step']:.2f} | {r['final_train_loss']:.4f} |"
        )
    lines += ["", f"compiled / eager median step time: {compiled['median_step_ms'] / eager['median_step_ms']:.2f}"]
    table = "\n".join(lines)
    print(table)
    (ROOT / "docs" / "step_time.md").write_text("# Step time: compiled vs eager\n\n" + table + "\n")


if __name__ == "__main__":
    main()
