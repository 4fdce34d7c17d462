"""zpp_compile: ZeRO++ as a torch.compile backend.

zpp_compile.shard(model, zpp_compile.Config())
model = torch.compile(model, backend="zeropp")
"""

from . import compat as _compat  # noqa: F401  (first: checks the torch version and its private APIs)
from . import ops as _ops  # noqa: F401  (registers the zpp:: custom ops)
from .backend import (
    BACKEND_NAME,
    NotShardedError,
    RecompileStormWarning,
    compiled_graphs,
    zeropp_backend,
)
from .backend import (
    register as _register_backend,
)
from .checkpoint import (
    CheckpointMismatchError,
    latest_checkpoint,
    load_checkpoint,
    load_optimizer_state_dict,
    optimizer_state_dict,
    save_checkpoint,
)
from .clip import clip_grad_norm_, get_total_norm
from .comm import Collective, CommCounter, comm_counter
from .config import Config
from .error_feedback import clear_error_feedback
from .explain import explain
from .faults import CollectiveError
from .grad_sync import (
    PendingGradientsError,
    clear_gradient_buffers,
    no_sync,
    pending_gradient_bytes,
    set_requires_gradient_sync,
)
from .initialize import materialize
from .layout import ShardingError, is_sharded
from .plan import CommPlan, peak_collective_bytes
from .process_state import reset
from .schedule_check import ScheduleMismatchError
from .sharding import broadcast_buffers, full_state_dict, shard
from .topology import DistributedNotInitializedError, Topology
from .weights import load_full_state_dict, load_safetensors

_register_backend()

__all__ = [
    "BACKEND_NAME",
    "CheckpointMismatchError",
    "Collective",
    "CollectiveError",
    "CommCounter",
    "CommPlan",
    "Config",
    "DistributedNotInitializedError",
    "NotShardedError",
    "PendingGradientsError",
    "RecompileStormWarning",
    "ScheduleMismatchError",
    "ShardingError",
    "Topology",
    "broadcast_buffers",
    "comm_counter",
    "clear_error_feedback",
    "clear_gradient_buffers",
    "clip_grad_norm_",
    "compiled_graphs",
    "explain",
    "full_state_dict",
    "get_total_norm",
    "is_sharded",
    "load_full_state_dict",
    "load_safetensors",
    "latest_checkpoint",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "materialize",
    "no_sync",
    "optimizer_state_dict",
    "peak_collective_bytes",
    "pending_gradient_bytes",
    "reset",
    "save_checkpoint",
    "set_requires_gradient_sync",
    "shard",
    "zeropp_backend",
]
__version__ = "0.1.0"
