"""Sharded checkpoints: state dicts and torch.distributed.checkpoint (DCP) without gathering.

Sharded parameters are DTensors (Shard(0) over the world), so a model's state_dict() holds them
under their original names and shapes, and DCP saves each rank's chunk and reshards on load: a
checkpoint saved at one world size loads at another, and every consumer of DCP checkpoints
(`dcp_to_torch_save`, an unsharded model, FSDP2) sees ordinary tensors. The format is documented
in docs/checkpoints.md.

  state_dict.py  the state-dict hooks shard() installs (full tensors in, int8-stored frozen weights)
  optimizer.py   optimizer state dicts keyed by parameter name, sharded like the model
  dcp_io.py      save_checkpoint / load_checkpoint through DCP
"""

from .dcp_io import EXTRA_KEY, MODEL_KEY, OPTIM_KEY, PathLike, load_checkpoint, save_checkpoint
from .optimizer import load_optimizer_state_dict, optimizer_state_dict
from .state_dict import CheckpointMismatchError, as_sharded_like, full_value, install_state_dict_hooks, stored_values

__all__ = [
    "EXTRA_KEY",
    "MODEL_KEY",
    "OPTIM_KEY",
    "CheckpointMismatchError",
    "PathLike",
    "as_sharded_like",
    "full_value",
    "install_state_dict_hooks",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "save_checkpoint",
    "stored_values",
]
