"""Sharded checkpoints: state dicts and torch.distributed.checkpoint (DCP) without gathering.

A sharded parameter appears in a state dict under its original name and original shape, as a
FlatShardedTensor: a tensor-like object that holds only this rank's flat slice [start, stop) of
the row-major flattened parameter (the shard without its padding). DCP sees it as a tensor of the
original shape made of a few rectangular chunks, each a view of the shard, so every rank writes
and reads only its own elements, and a checkpoint saved at one world size loads at another: DCP
works out which saved chunks overlap which wanted ones. A DCP checkpoint of a sharded model is
therefore an ordinary one: every consumer (`dcp_to_torch_save`, a plain unsharded model with DCP)
sees normal, unpadded tensors. The format is documented in docs/checkpoints.md.

  flat_sharded_tensor.py  FlatShardedTensor and its geometry (DCP's chunk protocol)
  state_dict.py           the state-dict hooks shard() installs; loading a value into a shard
  optimizer.py            optimizer state dicts keyed by parameter name, sharded like the model
  dcp_io.py               save_checkpoint / load_checkpoint through DCP
"""

from .dcp_io import EXTRA_KEY, MODEL_KEY, OPTIM_KEY, PathLike, load_checkpoint, save_checkpoint
from .flat_sharded_tensor import FlatShardedTensor, flat_boxes, local_range
from .optimizer import SHARDED_STATE_KEY, load_optimizer_state_dict, optimizer_state_dict
from .state_dict import CheckpointMismatchError, install_state_dict_hooks, load_into_shard, sharded_entry

__all__ = [
    "EXTRA_KEY",
    "MODEL_KEY",
    "OPTIM_KEY",
    "SHARDED_STATE_KEY",
    "CheckpointMismatchError",
    "FlatShardedTensor",
    "PathLike",
    "flat_boxes",
    "install_state_dict_hooks",
    "load_checkpoint",
    "load_into_shard",
    "load_optimizer_state_dict",
    "local_range",
    "optimizer_state_dict",
    "save_checkpoint",
    "sharded_entry",
]
