"""How a parameter is split across ranks: ShardSpec, the state shard() attaches, and their accessors.

Every layer that needs to know what a sharded parameter is (the backend, the passes, checkpoints,
clipping, initialization) reads it from here; none of them needs `shard()` itself, so the import
direction is one way: layout <- sharding, checkpoint, backend.

The split is FSDP2's: a parameter of shape [d0, *rest] is cut along dim 0 into `world` chunks of
ceil(d0 / world) rows (torch.chunk; trailing ranks may hold fewer rows, or none), and exposed as a
DTensor with placement Shard(0) on a 1-D mesh over the world. A 0-d parameter cannot be cut and is
Replicate(): every rank holds it, and its gradient is all-reduced. So is a parameter of at most
Config.keep_whole_numel elements (ShardSpec.kept_whole; under plan="auto" the plan sets the
threshold). The collectives move each rank's chunk zero-padded to ceil(d0 / world) rows
(`shard_numel` elements), so every rank sends the same number of bytes and the gathered buffer is
the full tensor, row-major, followed by zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import Tensor, nn

from .codegen.quantize import ceil_div
from .config import Config
from .topology import Topology

if TYPE_CHECKING:
    from .cost_model import CostModel


class ShardingError(RuntimeError):
    """A sharded model was changed in a way its shards cannot follow (replaced, added, moved), or
    the ranks disagree about what they shard."""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What a shard is a piece of: the full parameter's name, shape, and the group it is split over.

    quantized_block is set when the shard is stored as its packed int8 payload
    (Config.quantize_frozen_weights); dtype is then the dtype it dequantizes to.
    compute_dtype / reduce_dtype (mixed precision) are None where they equal the shard's dtype,
    so a model without mixed precision traces exactly the graphs it did before.
    """

    fqn: str
    shape: tuple[int, ...]
    numel: int
    group_size: int
    group_name: str
    dtype: torch.dtype = torch.float32
    quantized_block: Optional[int] = None
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    device: torch.device = torch.device("cpu")  # where the shard lives; moving it later is refused
    plan_id: int = 0  # which shard() call made it: compiled graphs are specialised on it (see gather_full)
    requires_grad: bool = True  # at shard(): whether a gradient shard is to be expected (memory estimates)
    # Config.keep_whole_numel: every rank holds the whole parameter (Replicate), though it has a dim to cut.
    kept_whole: bool = False

    def __post_init__(self) -> None:
        # What every read of the parameter in forward passes to its gather op, worked out once:
        # Dynamo traces each read (a model's every parameter, on every restart of its analysis),
        # and the properties below cost it hundreds of bytecodes per read.
        kwargs = {"dtype": self.compute_dtype, "reduce_dtype": self.reduce_dtype}
        gather_args = (self.numel, list(self.shape), self.shard_numel, self.group_size, self.group_name)
        object.__setattr__(self, "gather_args", gather_args)
        object.__setattr__(self, "gather_kwargs", {k: v for k, v in kwargs.items() if v is not None})
        # Whether it belongs to a repeated block: what the forward's tail is cut by
        # (Config.keep_last_weights_gathered). gather_full branches on it, so Dynamo guards on it.
        object.__setattr__(self, "in_block", bool(block_of_name(self.fqn)))

    @property
    def replicated(self) -> bool:
        """Every rank holds all of it (DTensor Replicate): a 0-d parameter, or one kept whole."""
        return not self.shape or self.kept_whole

    @property
    def rows_per_rank(self) -> int:
        """Rows of dim 0 in every rank's padded chunk (torch.chunk's chunk size; all rows when
        replicated, 1 for a 0-d parameter)."""
        if self.replicated:
            return self.shape[0] if self.shape else 1
        return ceil_div(self.shape[0], self.group_size)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def shard_numel(self) -> int:
        """Elements each rank sends in a gather of this parameter (its chunk, zero-padded)."""
        return self.rows_per_rank * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer: the full parameter followed by zeros (a replicated
        parameter is never gathered: its own elements)."""
        return self.numel if self.replicated else self.shard_numel * self.group_size

    def local_rows(self, rank: int) -> int:
        """Rows of dim 0 that `rank` holds (0 for trailing ranks of a short parameter)."""
        if self.replicated:
            return self.rows_per_rank
        return max(0, min(self.rows_per_rank, self.shape[0] - rank * self.rows_per_rank))

    def row_range(self, rank: int) -> tuple[int, int]:
        """Rows [start, stop) of dim 0 that `rank` holds ((0, 0) for a 0-d parameter)."""
        if not self.shape:
            return 0, 0
        start = 0 if self.replicated else rank * self.rows_per_rank
        return start, start + self.local_rows(rank)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s DTensor local tensor."""
        return self.shape if self.replicated else (self.local_rows(rank), *self.shape[1:])

    def local_numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    def local_range(self, rank: int) -> tuple[int, int]:
        """Elements [start, stop) of the flattened full parameter that `rank` holds."""
        if self.replicated:
            return 0, self.numel
        start = min(rank * self.shard_numel, self.numel)
        return start, start + self.local_numel(rank)


@dataclasses.dataclass
class ShardedState:
    """Attached to the root module by shard(): the config and layout every compiled graph reads."""

    config: Config
    topology: Topology
    specs: dict[str, ShardSpec]
    mesh: object = None  # the DeviceMesh the parameters' DTensors live on
    cost_model: Optional[CostModel] = None
    plan_id: int = 0  # this shard() call's number in the process (ShardSpec.plan_id)
    recompile_storm_reported: bool = False
    # "sync", "accumulate" (under no_sync) or "flush" (synchronised, gradients pending): grad_sync.py
    grad_sync: str = "sync"
    # Config(plan="auto"): the plan of each graph compiled for this model (auto_plan.AutoPlan), in order.
    auto_plans: list = dataclasses.field(default_factory=list)
    # Config.plan_trial_steps: the graphs whose candidate plans are still to be timed, in compile
    # order; the first is being timed (plan_trial.PlanTrial).
    plan_trials: list = dataclasses.field(default_factory=list)
    # Config.plan_trial_steps: what earlier runs' trials kept (auto_plan.trial_key -> option name),
    # the same on every rank (plan_trial.agreed_kept_plans).
    kept_by_trials: dict = dataclasses.field(default_factory=dict)
    memory_budget_bytes: int = 0  # Config(plan="auto"): the budget every rank plans with (auto_plan.settle_budget)
    keep_whole_numel: int = 0  # the Config's, or under plan="auto" the one chosen (auto_plan.choose_keep_whole_numel)

    @functools.cached_property
    def has_blocks(self) -> bool:
        """Whether any parameter belongs to a repeated block ("h.3.attn.weight")."""
        return any(block_of_name(fqn) for fqn in self.specs)


def block_of_name(fqn: str) -> str:
    """The repeated block a parameter belongs to: its name up to the first index
    ("transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"); "" outside any block."""
    parts = fqn.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if index is None else ".".join(parts[: index + 1])


def is_sharded(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_zpp_state", None), ShardedState)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module torch.compile(model) wraps (its _orig_mod), or `model` itself."""
    return getattr(model, "_orig_mod", model)


def sharded_state(model: nn.Module) -> ShardedState:
    model = unwrap_compiled(model)
    if not is_sharded(model):
        raise ValueError("this model is not sharded: call zpp_compile.shard(model, zpp_compile.Config()) first.")
    return model._zpp_state


def state_of_part(module: nn.Module) -> ShardedState:
    """The ShardedState of a sharded model, or of the sharded model `module` is a part of (found
    through its parameters: the transformers model inside a sharded PEFT model, which
    `merge_and_unload()` hands back)."""
    module = unwrap_compiled(module)
    if is_sharded(module):
        return module._zpp_state
    state = next((s for s in map(state_of_shard, module.parameters()) if s is not None), None)
    if state is None:
        raise ValueError("this model is not sharded: call zpp_compile.shard(model, zpp_compile.Config()) first.")
    return state


def shard_spec(param: Tensor) -> Optional[ShardSpec]:
    """The ShardSpec of a parameter created by shard() (or its int8 payload), None for any other tensor."""
    return getattr(param, "_zpp_spec", None)


def state_of_shard(param: Tensor) -> Optional[ShardedState]:
    """The ShardedState of the model a shard belongs to, or None for any other tensor."""
    return getattr(param, "_zpp_state", None)


PAYLOAD_SUFFIX = "_zpp_int8"  # buffer name suffix of a frozen weight stored as its int8 payload


def int8_payload(module: nn.Module, name: str) -> Optional[Tensor]:
    """The int8 payload of `module.<name>` if it is a frozen weight stored quantized, else None."""
    return module._buffers.get(name + PAYLOAD_SUFFIX)


def state_dict_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Tensor]]:
    """(state-dict name, owning module, attribute name, tensor) of every parameter and persistent
    buffer, module by module as state_dict() walks them, a tied tensor under each of its names."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                yield join_fqn(module_name, name), module, name, p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield join_fqn(module_name, name), module, name, b


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
