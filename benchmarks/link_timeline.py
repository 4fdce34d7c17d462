"""When the link between the two simulated nodes is busy during a training step, phase by phase.

    sudo python benchmarks/link_timeline.py --rate 100mbit --configs "zeropp qwZ+hpZ+hier."

For each config (names of cluster_worker.py's CONFIGS), on benchmarks/cluster.py's two
namespaces: a few warm-up steps, then timed steps with every rank logging when its forward,
backward and optimizer step end, while a sampler in node 0's namespace reads the veth's byte
counters every 2 ms. Prints, per step, each phase's bytes in each direction and how busy the link
was (bytes / (rate x the phase's time)), then the step of median length in 20 ms bins. A phase
below ~80% busy while the step is link-bound is time the schedule left the link idle: this is how
a two-stage reduce whose second stage waited for the backward's end showed (docs/auto_plan.md).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import (  # noqa: E402
    link_counters,
    rate_bytes_per_s,
    run_on_cluster,
    set_link_rate,
    two_node_cluster,
)

SAMPLE_S = 0.002
BIN_S = 0.02
PHASES = ("forward", "backward", "optimizer")


# -- what the measurements say (pure: tested) ----------------------------------------------------


@dataclass
class Samples:
    """Node 0's veth counters over time: (monotonic seconds, tx bytes, rx bytes) in time order."""

    rows: list[tuple[float, int, int]]

    def __post_init__(self) -> None:
        self._times = [row[0] for row in self.rows]

    def bytes_between(self, start: float, end: float) -> tuple[int, int]:
        """(tx, rx) bytes counted between the samples nearest after `start` and after `end`."""
        (_, tx0, rx0), (_, tx1, rx1) = self._at(start), self._at(end)
        return tx1 - tx0, rx1 - rx0

    def _at(self, t: float) -> tuple[float, int, int]:
        return self.rows[min(bisect.bisect_left(self._times, t), len(self.rows) - 1)]


def busy(bytes_moved: int, seconds: float, bytes_per_s: float) -> float:
    """The fraction of `seconds` a link of `bytes_per_s` needs to move `bytes_moved`."""
    return bytes_moved / bytes_per_s / seconds if seconds > 0 else 0.0


def phase_rows(samples: Samples, marks: tuple[float, float, float, float], bytes_per_s: float) -> list[str]:
    """One line per phase of a step (marks: its start and each phase's end, rank 0's clock)."""
    rows = []
    for name, start, end in zip(PHASES, marks, marks[1:]):
        tx, rx = samples.bytes_between(start, end)
        rows.append(
            f"  {name:9s} {1e3 * (end - start):6.0f} ms   tx {tx / 1e6:6.2f} MB ({busy(tx, end - start, bytes_per_s):4.0%})"
            f"   rx {rx / 1e6:6.2f} MB ({busy(rx, end - start, bytes_per_s):4.0%})"
        )
    return rows


def timeline(samples: Samples, marks: tuple[float, float, float, float], end: float, bytes_per_s: float) -> list[str]:
    """The step in BIN_S bins up to `end` (the slowest rank's end): phase letter, tx and rx busy."""
    rows = []
    for i in range(math.ceil((end - marks[0]) / BIN_S - 1e-9)):
        t = marks[0] + i * BIN_S
        phase = next((name[0].upper() for name, stop in zip(PHASES, marks[1:]) if t < stop), "-")
        tx, rx = samples.bytes_between(t, t + BIN_S)
        rows.append(
            f"  {1e3 * i * BIN_S:5.0f} ms {phase}  tx {busy(tx, BIN_S, bytes_per_s):4.0%}  rx {busy(rx, BIN_S, bytes_per_s):4.0%}"
        )
    return rows


def report(name: str, samples: Samples, marks_by_rank: list[list[tuple]], bytes_per_s: float) -> str:
    """Every timed step's phases (rank 0), and the median-length step's timeline."""
    steps = list(zip(*marks_by_rank))  # per step: every rank's marks
    ends = [max(m[3] for m in step) for step in steps]
    lengths = [end - step[0][0] for step, end in zip(steps, ends)]
    lines = [f"== {name}: step (slowest rank) median {1e3 * statistics.median(lengths):.0f} ms"]
    for i, (step, length) in enumerate(zip(steps, lengths)):
        lines += [f" step {i}: {1e3 * length:.0f} ms", *phase_rows(samples, step[0], bytes_per_s)]
    median = sorted(range(len(steps)), key=lengths.__getitem__)[len(steps) // 2]
    lines += [f" step {median} in {1e3 * BIN_S:.0f} ms bins (F forward, B backward, O optimizer, - other ranks):"]
    return "\n".join(lines + timeline(samples, steps[median][0], ends[median], bytes_per_s))


# -- the sampler and the worker (run inside the namespaces) --------------------------------------


def sample(out: str) -> None:
    """Read node 0's veth counters every SAMPLE_S until SIGTERM, then write them to `out`."""
    rows, stopped = [], []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    while not stopped:
        rows.append((time.monotonic(), *link_counters()))
        time.sleep(SAMPLE_S)
    Path(out).write_text(json.dumps(rows))


def work(out: str, names: list[str], steps: int) -> None:
    """One rank: each config's warm-up, then `steps` timed steps (rank 0 runs the sampler)."""
    import torch
    import torch.distributed as dist

    from benchmarks import cluster_worker as cw

    tokens = cw.start_rank()
    results = {}
    for i, name in enumerate(names):
        model, run = cw.BUILDERS[cw.ALL_CONFIGS[name][0]](cw.ALL_CONFIGS[name][1])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> tuple[float, float, float, float]:
            dist.barrier()
            start = time.monotonic()
            loss = run(tokens[:, :-1], tokens[:, 1:])
            forward = time.monotonic()
            loss.backward()
            backward = time.monotonic()
            opt.step()
            opt.zero_grad()
            return start, forward, backward, time.monotonic()

        for _ in range(3):  # compile, then the lazily compiled backward and a warm step
            step()
        sampler = None
        if dist.get_rank() == 0:
            sampler = subprocess.Popen([sys.executable, __file__, "--sample", f"{out}.{i}"])
            time.sleep(0.5)
        marks = [step() for _ in range(steps)]
        dist.barrier()
        if sampler is not None:
            time.sleep(0.2)
            sampler.terminate()
            sampler.wait()
        everyone: list[Optional[list]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, marks)
        results[name] = everyone
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="a tc rate, e.g. 100mbit or 1gbit")
    p.add_argument("--configs", default="zeropp qwZ+hpZ+hier.", help="comma-separated cluster_worker.py CONFIGS")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sample", help=argparse.SUPPRESS)  # internal: the sampler process
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one rank, under torchrun
    args = p.parse_args()
    names = args.configs.split(",")
    rate = rate_bytes_per_s(args.rate)  # refused before any namespace exists
    if args.sample:
        return sample(args.sample)
    if args.worker:
        return work(args.worker, names, args.steps)
    with two_node_cluster(), tempfile.TemporaryDirectory() as tmp:
        set_link_rate(args.rate)
        out = os.path.join(tmp, "marks.json")
        worker = [__file__, "--worker", out, "--configs", args.configs, "--steps", str(args.steps)]
        run_on_cluster(worker, 2, 3600, {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")})
        marks = json.loads(Path(out).read_text())
        for i, name in enumerate(names):
            samples = Samples([tuple(row) for row in json.loads(Path(f"{out}.{i}").read_text())])
            print(report(name, samples, marks[name], rate))


if __name__ == "__main__":
    main()
