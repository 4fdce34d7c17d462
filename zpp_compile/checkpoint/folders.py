"""Checkpoint folders: written atomically, marked complete, and found again on resume.

save_checkpoint never writes into the folder it is asked for. It writes into a temporary sibling,
`<path>.partial-<token>`; once every rank has written its files, rank 0 puts the completion marker
(MARKER_NAME) into it, moves the previous `<path>` aside to `<path>.old-<token>`, renames the
temporary folder to `<path>` and deletes the old one. A save killed at any point therefore leaves
`<path>` as it was (or, between the two renames, absent), plus a leftover folder whose name says
what it is; it never leaves a folder that looks complete and is not.

A folder is complete when it holds the marker. Folders written before the marker existed
(zpp_compile 0.1, or plain dcp.save) are "legacy": complete when DCP's `.metadata` is there and
every data file it names is there with all its bytes. That rule cannot tell a legacy folder whose
files were rewritten in place to the same sizes from a whole one; the marker can.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional, Union

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .state_dict import CheckpointMismatchError

PathLike = Union[str, os.PathLike]

MARKER_NAME = "zpp_checkpoint.json"
FORMAT_VERSION = 1  # the first format with a marker; legacy folders have none
PARTIAL_TAG = ".partial-"  # <path>.partial-<token>: what a save is writing
OLD_TAG = ".old-"  # <path>.old-<token>: the folder a save is replacing
METADATA_NAME = ".metadata"  # DCP's, written last by its coordinator rank
DATA_SUFFIX = ".distcp"  # DCP's FileSystemWriter: __<rank>_<n>.distcp

# What a checkpoint folder may hold, so that replacing it deletes nothing else.
_CHECKPOINT_FILE = re.compile(rf"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|{re.escape(MARKER_NAME)}")


@dataclasses.dataclass(frozen=True)
class Marker:
    """The completion marker: written by rank 0 once every rank has written its files."""

    format: int
    world_size: int
    saved_at: str  # UTC, ISO 8601
    optimizer: Optional[str]  # module-qualified class name, None when saved without an optimizer
    checksums: Optional[dict[str, str]]  # data file name -> sha256 hex digest, when saved with checksums

    @classmethod
    def new(cls, world_size: int, optimizer: Optional[str], checksums: Optional[dict[str, str]]) -> Marker:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(FORMAT_VERSION, world_size, now, optimizer, checksums)

    def write(self, folder: Path) -> None:
        with open(folder / MARKER_NAME, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())  # on disk before the folder is renamed into place


def read_marker(folder: PathLike) -> Optional[Marker]:
    """The folder's completion marker, None when it has none (legacy or incomplete).

    Raises CheckpointMismatchError when the marker cannot be read or is of a newer format.
    """
    file = Path(folder) / MARKER_NAME
    if not file.exists():
        return None
    try:
        fields: dict[str, Any] = json.loads(file.read_text())
        marker = Marker(**fields)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointMismatchError(f"the completion marker {str(file)!r} cannot be read ({err})") from err
    if marker.format > FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(folder)!r} is of format {marker.format}, written by a newer zpp_compile; "
            f"this one reads formats up to {FORMAT_VERSION}: upgrade zpp_compile to load it"
        )
    return marker


def read_metadata(folder: PathLike) -> Metadata:
    return FileSystemReader(folder).read_metadata()


def incompleteness(folder: PathLike) -> Optional[str]:
    """Why `folder` is not a complete checkpoint (a phrase), or None when it is one.

    Reads only the marker, DCP's .metadata and the data files' sizes: cheap, no data is read.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "it does not exist" if not folder.exists() else "it is not a folder"
    try:
        marked = read_marker(folder) is not None
    except CheckpointMismatchError as err:
        return str(err)
    if not marked and PARTIAL_TAG in folder.name:
        return "it is the temporary folder of a save that did not finish (it has no completion marker)"
    if not (folder / METADATA_NAME).exists():
        return f"it has no DCP {METADATA_NAME}: a save into it did not finish"
    try:
        metadata = read_metadata(folder)
    except Exception as err:  # a truncated pickle raises EOFError, UnpicklingError, ...
        return f"its {METADATA_NAME} cannot be read ({type(err).__name__}: {err})"
    return _short_data_file(folder, metadata)


def _short_data_file(folder: Path, metadata: Metadata) -> Optional[str]:
    """The first data file that is missing or shorter than the .metadata says, in words."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = folder / name
        if not file.exists():
            return f"its data file {name} is missing"
        if file.stat().st_size < size:
            return (
                f"its data file {name} has {file.stat().st_size} of the {size} bytes its {METADATA_NAME} names "
                "(a save was killed while writing it, or the file was cut short since)"
            )
    return None


def require_complete(folder: PathLike) -> Optional[Marker]:
    """The folder's marker (None for a complete legacy folder); raises CheckpointMismatchError
    naming the folder when it is incomplete (or its marker unreadable or too new), and
    FileNotFoundError when it does not exist."""
    if not Path(folder).exists():
        raise FileNotFoundError(
            f"checkpoint {os.fspath(folder)!r} does not exist: zpp_compile.latest_checkpoint(directory) finds "
            "the newest complete one"
        )
    marker = read_marker(folder)  # raises for a marker that cannot be read or is of a newer format
    reason = incompleteness(folder)
    if reason is not None:
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(folder)!r} is incomplete or damaged: {reason}. Load an older checkpoint: "
            "zpp_compile.latest_checkpoint(directory) finds the newest complete one"
        )
    return marker


def latest_checkpoint(directory: PathLike, prefix: str = "step_") -> Optional[Path]:
    """The newest complete checkpoint folder `<directory>/<prefix><N>` (largest integer N), or
    None when there is none.

    Warns (UserWarning) for every newer folder it skips, saying why: incomplete (a save that was
    killed), or a leftover `.partial-` / `.old-` folder of an interrupted save. Not collective and
    read-only: every rank gets the same answer from a shared file system.
    """
    for step, folder, leftover in _step_folders(Path(directory), prefix):
        reason = _leftover_reason(folder, prefix, step) if leftover else incompleteness(folder)
        if reason is None:
            return folder
        warnings.warn(f"zpp_compile.latest_checkpoint: skipping {str(folder)!r}: {reason}", UserWarning, stacklevel=2)
    return None


def _step_folders(directory: Path, prefix: str) -> list[tuple[int, Path, bool]]:
    """(N, folder, is a leftover) for `<prefix><N>` and its leftovers, newest first; at one N the
    leftovers come before the folder (they are what a later save of it left)."""
    name = re.compile(rf"{re.escape(prefix)}(\d+)((?:{re.escape(PARTIAL_TAG)}|{re.escape(OLD_TAG)})[0-9a-f]+)?")
    found = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        match = name.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry, match.group(2) is not None))
    return sorted(found, key=lambda f: (f[0], f[2], f[1].name), reverse=True)


def _leftover_reason(folder: Path, prefix: str, step: int) -> str:
    target = f"{prefix}{step}"
    if OLD_TAG in folder.name:
        return (
            f"it is the previous {target}, set aside by a save that was interrupted before deleting it "
            f"(delete it; or rename it back to {target} if {target} is missing)"
        )
    if incompleteness(folder) is None:
        return (
            f"it is a complete save of {target} that was interrupted while being renamed into place "
            f"(rename it to {target} to resume from it)"
        )
    return "it is the temporary folder of a save that did not finish (delete it)"


@dataclasses.dataclass(frozen=True)
class SaveFolders:
    """Where one save writes (`staging`) and what it replaces (`target`), with the folder the
    previous `target` is moved to for the moment of the swap (`aside`)."""

    target: Path
    token: str

    @property
    def staging(self) -> Path:
        return self.target.with_name(f"{self.target.name}{PARTIAL_TAG}{self.token}")

    @property
    def aside(self) -> Path:
        return self.target.with_name(f"{self.target.name}{OLD_TAG}{self.token}")

    @classmethod
    def new(cls, target: PathLike) -> SaveFolders:
        """A fresh token for a save to `target` (on rank 0), after checking `target` may be replaced."""
        target = Path(target)
        _check_replaceable(target)
        return cls(target, secrets.token_hex(4))

    def publish(self, marker: Marker) -> None:
        """Mark the staging folder complete and swap it in for the target (on rank 0, once every
        rank has written its files)."""
        marker.write(self.staging)
        if self.target.exists():
            self.target.rename(self.aside)
        self.staging.rename(self.target)
        shutil.rmtree(self.aside, ignore_errors=True)


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything but a checkpoint folder: the swap deletes the previous one."""
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(
            f"save_checkpoint: {str(target)!r} is a file, not a checkpoint folder: choose another path"
        )
    others = sorted(e.name for e in target.iterdir() if not (e.is_file() and _CHECKPOINT_FILE.fullmatch(e.name)))
    if others:
        raise FileExistsError(
            f"save_checkpoint: {str(target)!r} holds {others[:5]}{' ...' if len(others) > 5 else ''} besides "
            "checkpoint files, and a save replaces the whole folder: save to a folder of its own "
            "(e.g. <dir>/step_<N>) or move those files away"
        )
