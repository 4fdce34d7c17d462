"""Each rank's random-number-generator states in a checkpoint, so that dropout resumes exactly
(rows per rank: per_rank.py; restored at the world size they were saved at only)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DeviceMesh, DTensor

from .per_rank import as_rows, own_rows, rows_load_target

RNG_KEY = "rng"
CPU = "cpu"  # torch.get_rng_state()
CUDA = "cuda"  # torch.cuda.get_rng_state() of the current device, when CUDA is initialized


def rng_states(mesh: DeviceMesh) -> dict[str, DTensor]:
    """This rank's generator states as its rows of [world, n] DTensors, for save_checkpoint."""
    states = {CPU: torch.get_rng_state()}
    if torch.cuda.is_initialized():
        states[CUDA] = torch.cuda.get_rng_state()
    return {device: as_rows(state, mesh) for device, state in states.items()}


def rng_load_target(saved: dict, mesh: DeviceMesh, where: str) -> dict[str, DTensor]:
    """Rows for this rank's saved states ({} for a checkpoint without them: zpp_compile 0.1)."""
    restorable = {device: v for device, v in saved.items() if device == CPU or torch.cuda.is_available()}
    return rows_load_target(restorable, mesh, "RNG states", where)


def restore_rng_states(loaded: dict[str, DTensor]) -> None:
    """Set this rank's generators to its rows of what dcp.load read into rng_load_target()."""
    for device, state in own_rows(loaded).items():
        if device == CPU:
            torch.set_rng_state(state.cpu())
        else:
            torch.cuda.set_rng_state(state.cpu())
