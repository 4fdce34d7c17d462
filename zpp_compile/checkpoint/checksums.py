"""sha256 checksums of a checkpoint's data files: recorded at save, checked before a load.

DCP itself checks nothing: a flipped bit in a data file loads as a wrong weight. With
save_checkpoint(..., checksums=True) each rank hashes the files it wrote (FileSystemWriter names
them `__<rank>_<n>.distcp`) and rank 0 records all digests in the completion marker; a load then
splits the files over its ranks (file i is hashed by rank i % world), so the reading cost is
shared, and every rank learns every rank's verdict, so all ranks raise the same error.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .folders import DATA_SUFFIX, PathLike
from .ranks import on_every_rank
from .state_dict import CheckpointMismatchError

_READ_BYTES = 1 << 20


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def gather_checksums(folder: Path, hash_files: bool = True) -> dict[str, str]:
    """{data file name: sha256} of the data files each rank wrote into `folder`, on every rank
    ({} without `hash_files`).

    Collective, and a barrier: each rank hashes its own files `__<rank>_<n>.distcp` (one
    all-gather, entered with or without `hash_files`). Call it once this rank's dcp.save has
    returned; when it returns, every rank's files are complete.
    """
    rank = dist.get_rank()

    def mine() -> dict[str, str]:
        return {f.name: sha256_of(f) for f in sorted(folder.glob(f"__{rank}_*{DATA_SUFFIX}"))} if hash_files else {}

    return {name: digest for digests in on_every_rank(mine) for name, digest in digests.items()}


def with_unclaimed_files(folder: Path, digests: dict[str, str]) -> dict[str, str]:
    """`digests` plus those of data files no rank claimed by name (a DCP writer that names its
    files otherwise), so that no file goes unchecked."""
    unclaimed = [f for f in sorted(folder.glob(f"*{DATA_SUFFIX}")) if f.name not in digests]
    return {**digests, **{f.name: sha256_of(f) for f in unclaimed}}


def verify_checksums(folder: PathLike, checksums: dict[str, str]) -> None:
    """Raise CheckpointMismatchError on every rank, naming each data file whose sha256 differs
    from `checksums` (or that is missing).

    Collective: rank r hashes files r, r + world, ... of the sorted names (one all-gather).
    """
    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(checksums)[rank::world]
    verdicts = on_every_rank(lambda: {n: p for n in names if (p := _file_problem(folder / n, checksums[n]))})
    problems = {name: problem for verdict in verdicts for name, problem in verdict.items()}
    if problems:
        lines = "\n  ".join(f"{name}: {problem}" for name, problem in sorted(problems.items()))
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(folder)!r} is corrupted: its data files do not match the checksums "
            f"recorded when it was saved:\n  {lines}\nLoad an older checkpoint, or restore these files from a copy"
        )


def _file_problem(file: Path, expected: str) -> Optional[str]:
    if not file.exists():
        return "missing"
    actual = sha256_of(file)
    return None if actual == expected else f"sha256 {actual}, recorded {expected}"
