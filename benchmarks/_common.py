"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def tracked(items: Iterable[T], desc: str) -> Iterator[T]:
    """Yield items under a progress bar on stderr (tqdm when installed, else a line every tenth of
    the way): shown by the launching process and by rank 0 of a worker group, silent on other ranks."""
    from examples.training_utils import progress

    items = list(items)
    enabled = os.environ.get("RANK", "0") == "0"
    with progress(len(items), enabled, desc) as bar:
        for item in items:
            yield item
            bar.update()


def step_peak_bytes(step: Callable[[], None]) -> int:
    """The highest live bytes allocated during step() over what was live before it, from
    torch.profiler's memory records (CPU: the only allocator statistics there are)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for record in sorted(records, key=lambda r: r.start_ns()):
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def reset_compiled_state() -> None:
    """Forget compiled graphs, the sharding layout and the rest of zpp_compile's process state
    (zpp_compile.reset()), so the next config in the same processes shards and compiles afresh."""
    import zpp_compile

    zpp_compile.reset()


def benchmark_parser(description: str) -> argparse.ArgumentParser:
    """The options every multi-process benchmark takes, plus the hidden worker ones."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def run_workers(script: str, nproc: int, worker_args: list[str], env: Optional[dict[str, str]] = None) -> list[dict]:
    """Run `script --worker --out FILE *worker_args` on nproc CPU processes under torchrun (with
    `env` added to the environment) and return what rank 0 wrote to FILE (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, "--worker", "--out", out, *worker_args]  # fmt: skip
        done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        if done.returncode != 0:
            if not Path(out).exists():
                raise subprocess.CalledProcessError(done.returncode, cmd)
            # Rank 0 writes the file after every rank has measured: what failed is the teardown
            # (gloo's threads at exit: "terminate called without an active exception", seen in
            # eager zeropp and FSDP2 runs alike), not the measurement.
            print(f"warning: the workers exited with {done.returncode} after writing their results", file=sys.stderr)
        return json.loads(Path(out).read_text())


def worker_main(out: str, measure: Callable[[], object], timeout_s: int = 600) -> None:
    """A worker of run_workers: join the gloo group, run measure() and write rank 0's result (JSON)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    result = measure()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


HAND_WRITTEN = "## Reading the table (written by hand"


def publish(text: str, doc: str, title: str) -> None:
    """Print a benchmark's markdown and write it to docs/<doc> under `title`, keeping the doc's
    hand-written section (from a heading starting with HAND_WRITTEN to the end) as it is."""
    print(text)
    path = Path(__file__).resolve().parent.parent / "docs" / doc
    old = path.read_text() if path.exists() else ""
    kept = old[old.index(HAND_WRITTEN) :] if HAND_WRITTEN in old else ""
    path.write_text(f"# {title}\n\n{text}\n" + (f"\n{kept}" if kept else ""))
