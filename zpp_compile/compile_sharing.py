"""The ranks of one host compile each distinct Inductor region once between them
(Config.share_compiles, on by default).

Every rank compiles the same regions: the graphs are the same on every rank, down to shapes and
code. Left alone, every rank of a host would generate and build every kernel itself, all at the
same moment, on the host's shared cores. Where the ranks also share the Inductor cache directory
(Inductor's default on one host: one per user under the temporary folder; or the same
TORCHINDUCTOR_CACHE_DIR), that is wasted work: a region one rank compiled is an FX-graph cache hit
for the others.

So a rank about to compile a region first takes a file lock named by the region's digest (its
code and its inputs' shapes, strides, dtypes and devices) in the cache directory, without
waiting. If it gets the lock it compiles the region, which puts it in the FX-graph cache, and
lets the lock go. If another rank holds it, the region waits until this rank has compiled all
the others it could take; then the rank takes the lock, waiting this time, and compiles the
region: a cache hit. Regions go largest first, so the ranks of a host share the work as it comes.

No collective: ranks that compile different graphs (a rank-dependent shape recompiles one rank
only), or a rank alone in its cache, never wait on each other, and the training collectives can
never pair with these. The operating system releases a dead rank's locks (flock); a lock held
longer than the Config's collective timeout (30 min without one) is given up and the region
compiled anyway; a file system whose locks fail (some network or FUSE mounts) makes each rank
compile alone, logged once. A region another rank compiled that still misses the cache (a cache
key that differs where the digest does not) is compiled here, and logged. On a host with one GPU
per rank the regions differ by device index (Inductor keys on it): each rank compiles its own.

A graph Inductor compiles whole is one such job (inductor_regions.compile_whole). Graphs and
regions are the same on the ranks that share their groups because nothing rank-dependent is in
their code (passes/README.md, invariant 8): bucket_collectives gathers from the concatenation,
and hpZ's secondary shard is cut by zpp::owned_slot, which finds the rank's slot when it runs.
Ranks of different nodes differ by their groups' names (hpZ, qgZ), and compile their own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from filelock import FileLock, Timeout

from .cache_folders import cache_folder
from .compile_timing import fx_graph_cache_counts
from .inductor_regions import RegionCompile, compile_each
from .process_state import register_reset

log = logging.getLogger(__name__)

# Waiting for another rank's compile of a region without a Config.collective_timeout_s.
DEFAULT_WAIT_S = 1800.0
LOCK_FOLDER = "zpp_compile_regions"


@dataclasses.dataclass
class _Counts:
    compiled: int = 0  # regions this rank compiled without waiting (its own, or no lock to take)
    misses: int = 0  # FX-graph cache misses and bypasses among all the regions this rank compiled
    from_peers: int = 0  # regions it waited for while another rank compiled them
    peer_misses: int = 0  # of those, the ones that missed (or bypassed) the cache here anyway
    gave_up: int = 0  # regions whose lock another rank held past the wait: compiled here regardless


_COUNTS = _Counts()


@register_reset
def _reset() -> None:
    global _COUNTS
    _COUNTS = _Counts()


def counts() -> dict[str, int]:
    """This process's regions so far (a graph compiled whole counts as one; see _Counts):
    compiled without waiting, FX-graph cache misses, waited for while another rank compiled them,
    how many of those missed the cache anyway, and how many were compiled here after the wait ran
    out."""
    return dataclasses.asdict(_COUNTS)


def lock_folder() -> Optional[str]:
    """Where the region locks are: a folder of the Inductor cache directory; None where Inductor's
    local FX-graph cache is off (nothing another rank compiles would reach this one)."""
    return cache_folder(LOCK_FOLDER)


def run_compiles(jobs: list[RegionCompile], timeout_s: Optional[float] = None) -> None:
    """Compile every job (one distinct region of a graph), skipping ahead past the regions another
    rank sharing this cache directory is compiling, then compiling those: cache hits."""
    folder = _usable_lock_folder()
    before = _uncached()
    lockable = [job for job in jobs if job.digest is not None] if folder is not None else []
    _compile_all([job for job in jobs if job.digest is None or folder is None])
    waiting = []
    for job in sorted(lockable, key=lambda job: -job.size):
        lock = FileLock(os.path.join(folder, f"{job.digest}.lock"), fallback_to_soft=False)
        if _try_lock(lock, 0):
            _compile_holding(job, lock)
            _COUNTS.compiled += 1
        else:
            waiting.append((job, lock))
    _compile_after_peers(waiting, DEFAULT_WAIT_S if timeout_s is None else min(timeout_s, DEFAULT_WAIT_S))
    _COUNTS.misses += _uncached() - before


def _uncached() -> int:
    """FX-graph cache lookups so far that did not find a compiled graph (misses and bypasses)."""
    _, misses, bypasses = fx_graph_cache_counts()
    return misses + bypasses


def _usable_lock_folder() -> Optional[str]:
    folder = lock_folder()
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        _warn_unlockable(folder, error)
        return None
    return folder


def _try_lock(lock: FileLock, wait_s: float) -> bool:
    """Whether `lock` was taken within wait_s; a file system without working locks (an error other
    than the lock being held) counts as taken, so the region is compiled here, unshared."""
    try:
        lock.acquire(timeout=wait_s)
    except Timeout:
        return False
    except OSError as error:  # nothing taken: release() is then a no-op
        _warn_unlockable(os.path.dirname(lock.lock_file), error)
    return True


_WARNED: set[str] = set()


def _warn_unlockable(folder: str, error: OSError) -> None:
    if folder not in _WARNED:
        _WARNED.add(folder)
        log.warning("zpp_compile: cannot lock files in %s (%s): each rank compiles its regions itself", folder, error)


def _compile_all(jobs: list[RegionCompile]) -> None:
    compile_each(jobs)
    _COUNTS.compiled += len(jobs)


def _compile_holding(job: RegionCompile, lock: FileLock) -> None:
    try:
        job.compile()
    finally:  # also when the compile raises: the other ranks then compile it themselves
        lock.release()


def _compile_after_peers(waiting: list[tuple[RegionCompile, FileLock]], wait_s: float) -> None:
    before = _uncached()
    for job, lock in waiting:
        if _try_lock(lock, wait_s):
            _compile_holding(job, lock)
            _COUNTS.from_peers += 1
        else:
            log.warning(
                "zpp_compile: another rank held region %s for over %.0f s; compiling it here", job.digest, wait_s
            )
            job.compile()
            _COUNTS.gave_up += 1
    missed = _uncached() - before
    _COUNTS.peer_misses += missed
    if missed:
        log.warning(
            "zpp_compile: %d regions another rank compiled were not in this rank's Inductor cache "
            "(a miss or a bypass) and were compiled again",
            missed,
        )
