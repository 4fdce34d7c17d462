"""State that differs between ranks (RNG streams, qgZ's error feedback) in a checkpoint.

DCP writes a plain tensor or object once (from one rank), so each rank's tensor is stored as its
row of a [world, ...] DTensor, Shard(0) over the model's mesh: every rank writes its own row, as it
writes its chunk of a parameter. Such state describes one rank's place in the job and cannot be
resharded: it is restored only at the world size it was saved at; at another one the load warns
once per kind and leaves it as it is.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.distributed.tensor import DeviceMesh, DTensor, Shard


def as_rows(state: Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's `state` as its row of a [world, *state.shape] DTensor."""
    row = state.unsqueeze(0).contiguous()
    shape = (mesh.size(), *state.shape)
    return DTensor.from_local(
        row, mesh, [Shard(0)], shape=shape, stride=torch.empty(shape, device="meta").stride(), run_check=False
    )


def rows_load_target(
    saved: dict[str, tuple[torch.Size, torch.dtype]], mesh: DeviceMesh, what: str, where: str
) -> dict[str, DTensor]:
    """Empty rows for dcp.load to fill with this rank's saved `saved` entries ({name: (size,
    dtype)}); {} with one warning when they were saved at another world size."""
    saved_worlds = {size[0] for size, _ in saved.values()}
    if saved_worlds and saved_worlds != {mesh.size()}:
        warnings.warn(
            f"load_checkpoint({where!r}): {what} not restored: saved at world size {saved_worlds.pop()}, "
            f"and this is {mesh.size()}; a rank's state cannot be resharded, so it starts afresh here",
            UserWarning,
            stacklevel=4,  # the caller of load_checkpoint
        )
        return {}
    return {name: as_rows(torch.empty(size[1:], dtype=dtype), mesh) for name, (size, dtype) in saved.items()}


def own_rows(loaded: dict[str, DTensor]) -> dict[str, Tensor]:
    """This rank's rows of what dcp.load read into rows_load_target()."""
    return {name: value.to_local()[0] for name, value in loaded.items()}
