"""zpp_compile: ZeRO++ as a torch.compile backend.

    zpp_compile.shard(model, zpp_compile.Config())
    model = torch.compile(model, backend="zeropp")
"""

from . import ops as _ops  # noqa: F401  (registers the zpp:: custom ops)
from .backend import (
    BACKEND_NAME,
    NotShardedError,
    RecompileStormWarning,
    compiled_graphs,
    register as _register_backend,
    zeropp_backend,
)
from .checkpoint import (
    CheckpointMismatchError,
    FlatShardedTensor,
    load_checkpoint,
    load_optimizer_state_dict,
    optimizer_state_dict,
    save_checkpoint,
)
from .comm import Collective, CommCounter, comm_counter
from .config import Config
from .error_feedback import clear_error_feedback
from .explain import explain
from .faults import CollectiveError
from .plan import CommPlan, peak_collective_bytes
from .schedule_check import ScheduleMismatchError
from .sharding import ShardingError, full_state_dict, is_sharded, shard
from .topology import DistributedNotInitializedError, Topology

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
    "FlatShardedTensor",
    "NotShardedError",
    "RecompileStormWarning",
    "ScheduleMismatchError",
    "ShardingError",
    "Topology",
    "comm_counter",
    "clear_error_feedback",
    "compiled_graphs",
    "explain",
    "full_state_dict",
    "is_sharded",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "peak_collective_bytes",
    "save_checkpoint",
    "shard",
    "zeropp_backend",
]
__version__ = "0.1.0"
