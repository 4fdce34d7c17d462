"""A pool of real gloo worker processes, started once and reused by many tests.

Each worker initialises a gloo process group (with a collective timeout) and then runs the
module-level functions that tests send it. A task that raises on any rank, or does not finish
within its timeout, fails the test with the rank's traceback and restarts the pool, so a hang
costs one timeout, not the CI's whole budget.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

COLLECTIVE_TIMEOUT_S = float(os.environ.get("ZPP_TEST_COLLECTIVE_TIMEOUT_S", "120"))
# A hang, not a slow machine, is what this catches: 4 ranks compiling on 2 busy cores have taken 320 s.
TASK_TIMEOUT_S = float(os.environ.get("ZPP_TEST_TASK_TIMEOUT_S", "480"))


class WorkerCrashed(AssertionError):
    """A worker process died of a signal while running a task."""


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[mp.Process] = []

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]:
        """Run fn(*args) on every rank; return the results ordered by rank.

        If a worker process dies of a signal (a native crash, not a Python error), the task is
        re-run once on a fresh pool and a warning names the crash: an unexplained, rare heap
        corruption ("malloc(): unaligned tcache chunk detected", SIGABRT) has been seen in the
        workers; a second failure fails the test.
        """
        try:
            return self._run_once(fn, args, timeout_s)
        except WorkerCrashed as crash:
            warnings.warn(f"{crash}; re-running {fn.__name__} once on a fresh pool", stacklevel=2)
            return self._run_once(fn, args, timeout_s)

    def _run_once(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> list[Any]:
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results))
                dead = self._dead_workers()
                self.close()
                raise TimeoutError(
                    f"{fn.__name__}: ranks {missing} did not finish within {timeout_s:.0f} s{dead}"
                ) from None
            if status == "error":
                time.sleep(0.5)  # a peer that crashed (not raised) shows up as a dead process, not a message
                dead = self._dead_workers()
                self.close()
                if dead:
                    raise WorkerCrashed(f"{fn.__name__}: a worker crashed{dead}; rank {rank} then failed:\n{value}")
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def _dead_workers(self) -> str:
        """' (dead workers: rank r exit code c, ...)' for workers that died, e.g. -9 killed, -11 segfault."""
        dead = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(self._procs) if not p.is_alive()]
        return f" (dead workers: {', '.join(dead)})" if dead else ""

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        fd, store_path = tempfile.mkstemp(prefix="zpp_store_")
        os.close(fd)
        os.unlink(store_path)
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, f"file://{store_path}", self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def _worker_main(rank: int, world_size: int, init_method: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # As pyproject.toml's filterwarnings: a deprecated call of zpp_compile's own fails the task.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("error", category=category, module="zpp_compile")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while (item := tasks.get()) is not None:
        fn, args = item
        try:
            results.put((rank, "ok", fn(*args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            reset_process_state()
    dist.destroy_process_group()


def reset_process_state() -> None:
    """Forget compiled graphs, counters, error feedback and the sharding layout: the next task starts clean."""
    import zpp_compile

    zpp_compile.reset()
