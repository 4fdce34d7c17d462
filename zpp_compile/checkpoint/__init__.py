"""Sharded checkpoints: state dicts and torch.distributed.checkpoint (DCP) without gathering.

Sharded parameters are DTensors (Shard(0) over the world), so a model's state_dict() holds them
under their original names and shapes, and DCP saves each rank's chunk and reshards on load: a
checkpoint saved at one world size loads at another, and every consumer of DCP checkpoints
(`dcp_to_torch_save`, an unsharded model, FSDP2) sees ordinary tensors. The format is documented
in docs/checkpoints.md.

  state_dict.py  the state-dict hooks shard() installs (full tensors in, int8-stored frozen weights)
  optimizer.py   optimizer state dicts keyed by parameter name, sharded like the model
  dcp_io.py      save_checkpoint / load_checkpoint through DCP
  folders.py     atomic saves, the completion marker, latest_checkpoint
  checksums.py   sha256 of the data files, recorded at save and verified at load
  rng.py         each rank's RNG states, one row per rank
  ranks.py       file-system work on one or every rank, its outcome (or error) on all of them
"""

from .dcp_io import EXTRA_KEY, MODEL_KEY, OPTIM_KEY, load_checkpoint, save_checkpoint
from .folders import MARKER_NAME, PathLike, latest_checkpoint
from .optimizer import load_optimizer_state_dict, optimizer_state_dict
from .state_dict import CheckpointMismatchError, as_sharded_like, full_value, install_state_dict_hooks, stored_values

__all__ = [
    "EXTRA_KEY",
    "MARKER_NAME",
    "MODEL_KEY",
    "OPTIM_KEY",
    "CheckpointMismatchError",
    "PathLike",
    "as_sharded_like",
    "full_value",
    "install_state_dict_hooks",
    "latest_checkpoint",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "save_checkpoint",
    "stored_values",
]
