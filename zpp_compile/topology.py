"""Which ranks share a node: the world group, the node layout and the hpZ groups, derived
identically on every rank. Sub-groups are created once per process and shared by every model."""

from __future__ import annotations

import dataclasses
import datetime
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .config import Config
from .faults import as_timedelta
from .process_state import register_reset


class DistributedNotInitializedError(RuntimeError):
    pass


def require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedNotInitializedError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group() first "
            "(under torchrun: backend 'gloo' on CPU, 'nccl' on GPU)."
        )


@dataclasses.dataclass(frozen=True)
class Topology:
    """World size, this rank, and how ranks map to nodes (node = rank // ranks_per_node).

    hpZ: hpz_size consecutive ranks of one node form this rank's secondary-partition group
    (hpz_group_name); hpz_size 1 means hpZ is off and hpz_group_name is None.
    qgZ: node_group_name holds the ranks of this rank's node (in rank order, so member i is local
    rank i); cross_node_group_name the ranks with this rank's local index on every node (member
    i is on node i). Both are None unless a feature needs them; the cross-node one also on one node.
    """

    world_size: int
    rank: int
    ranks_per_node: int
    world_group_name: str
    hpz_size: int = 1
    hpz_group_name: Optional[str] = None
    node_group_name: Optional[str] = None
    cross_node_group_name: Optional[str] = None
    collective_timeout_s: Optional[float] = None  # the groups' timeout; None: the default group's

    @property
    def hpz_rank(self) -> int:
        """This rank's index inside its hpZ group: which 1/hpz_size of each weight it keeps."""
        return self.rank % self.hpz_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)


def build_topology(config: Config, *, collective: bool = True) -> Topology:
    """Read the layout from Config.ranks_per_node, else torchrun's LOCAL_WORLD_SIZE, else one node.

    `collective`: gather every rank's launcher variables first, so that every check below fails
    on all ranks together instead of leaving some waiting on a collective, and create the
    process groups; shard() does this (every rank must call it), current_topology()'s fallback not.
    """
    require_initialized("zpp_compile.shard")
    world = dist.get_world_size()
    launch = _launcher_layout() if collective and config.ranks_per_node is None else None
    ranks_per_node = config.ranks_per_node or _local_world_size(launch) or world
    if world % ranks_per_node:
        raise ValueError(
            f"world size {world} is not a multiple of ranks_per_node={ranks_per_node}: every node "
            "must hold the same number of ranks. Set Config(ranks_per_node=...) to a divisor of "
            f"{world}, or launch the same --nproc-per-node on every node."
        )
    if launch is not None:
        _check_node_of_rank(launch, ranks_per_node)
    rank = dist.get_rank()
    hpz_size = _checked_hpz_size(config, ranks_per_node, world)
    several_nodes = ranks_per_node < world
    if config.auto_plan and several_nodes:
        hpz_size = ranks_per_node  # the groups hpZ would use; each graph's plan says whether it does
    timeout_s = config.collective_timeout_s if collective else None
    return Topology(
        world_size=world,
        rank=rank,
        ranks_per_node=ranks_per_node,
        world_group_name=_world_group_name(world, timeout_s),
        collective_timeout_s=timeout_s,
        hpz_size=hpz_size,
        hpz_group_name=_hpz_group_name(world, rank, hpz_size, timeout_s),
        **(
            _node_group_names(world, rank, ranks_per_node, timeout_s)
            if collective
            and (
                config.quantize_gradients
                or config.hierarchical_reduce
                or config.hierarchical_gather
                or (config.auto_plan and (several_nodes or config.allow_lossy))
            )
            else {}
        ),
    )


def _world_group_name(world: int, timeout_s: Optional[float]) -> str:
    """The default group, or (with Config.collective_timeout_s) a world-wide group of that timeout."""
    if timeout_s is None:
        return dist.group.WORLD.group_name
    return shared_group(tuple(range(world)), timeout_s)


def _launcher_layout() -> list[tuple[Optional[str], Optional[str]]]:
    """(LOCAL_WORLD_SIZE, GROUP_RANK) of every rank, as the launcher set them (collective)."""
    layout: list = [None] * dist.get_world_size()
    dist.all_gather_object(layout, (os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("GROUP_RANK")))
    return layout


def _local_world_size(launch: Optional[list]) -> Optional[int]:
    """LOCAL_WORLD_SIZE: the value every rank agrees on (collective path) or this rank's own."""
    if launch is None:
        return _parse_local_world_size(os.environ.get("LOCAL_WORLD_SIZE"))
    sizes = {raw for raw, _ in launch}
    if len(sizes) > 1:
        per_rank = ", ".join(f"rank {r}: {raw}" for r, (raw, _) in enumerate(launch))
        raise ValueError(
            f"LOCAL_WORLD_SIZE differs between ranks ({per_rank}): zpp_compile needs the same number "
            "of ranks on every node. Launch the same --nproc-per-node everywhere, or set "
            "Config(ranks_per_node=...)."
        )
    return _parse_local_world_size(sizes.pop())


def _check_node_of_rank(launch: list, ranks_per_node: int) -> None:
    """Node = rank // ranks_per_node must agree with the launcher's node index (GROUP_RANK)."""
    for r, (_, raw) in enumerate(launch):
        if raw is not None and raw.isdigit() and int(raw) != r // ranks_per_node:
            raise ValueError(
                f"rank {r} runs on node {raw} (GROUP_RANK), but zpp_compile places it on node "
                f"{r // ranks_per_node} (rank // ranks_per_node={ranks_per_node}): the launcher does not "
                "number ranks node by node. Launch with torchrun's default rank assignment, or set "
                "Config(ranks_per_node=...) if you know the layout."
            )


def _checked_hpz_size(config: Config, ranks_per_node: int, world: int) -> int:
    if not config.hpz_enabled:
        return 1
    if ranks_per_node == world:
        warnings.warn(
            f"Config.hpz_size={config.hpz_size} on a single node: hpZ keeps extra secondary shards but "
            "there is no inter-node traffic for it to save. Set ranks_per_node (or launch on several "
            "nodes), or leave hpz_size unset.",
            stacklevel=3,
        )
    if ranks_per_node % config.hpz_size:
        raise ValueError(
            f"Config.hpz_size={config.hpz_size} must divide the ranks of a node (ranks_per_node="
            f"{ranks_per_node}), so that no hpZ group crosses nodes; use a divisor of {ranks_per_node}, "
            "e.g. hpz_size=ranks_per_node."
        )
    return config.hpz_size


def _hpz_group_name(world: int, rank: int, hpz_size: int, timeout_s: Optional[float]) -> Optional[str]:
    """Create (once per process) the hpZ groups of hpz_size consecutive ranks; return this rank's."""
    if hpz_size == 1:
        return None
    mine = None
    for first in range(0, world, hpz_size):  # every rank creates every group, in the same order
        ranks = tuple(range(first, first + hpz_size))
        group_name = shared_group(ranks, timeout_s)
        if rank in ranks:
            mine = group_name
    return mine


def _node_group_names(
    world: int, rank: int, ranks_per_node: int, timeout_s: Optional[float]
) -> dict[str, Optional[str]]:
    """Create (once per process) every node group and every cross-node group; return this rank's."""
    if ranks_per_node == world:
        return {"node_group_name": _world_group_name(world, timeout_s), "cross_node_group_name": None}
    nodes = range(0, world, ranks_per_node)
    node_groups = [shared_group(tuple(range(first, first + ranks_per_node)), timeout_s) for first in nodes]
    cross_groups = [
        shared_group(tuple(range(local, world, ranks_per_node)), timeout_s) for local in range(ranks_per_node)
    ]
    return {
        "node_group_name": node_groups[rank // ranks_per_node],
        "cross_node_group_name": cross_groups[rank % ranks_per_node],
    }


_GROUPS: dict[tuple[tuple[int, ...], Optional[float]], Optional[str]] = {}
_GROUP_TIMEOUTS: dict[str, float] = {}  # group name -> Config.collective_timeout_s it was made with


def shared_group(ranks: tuple[int, ...], timeout_s: Optional[float] = None) -> Optional[str]:
    """The name of the process group of `ranks` (None on ranks outside it), created on first use,
    with collective timeout `timeout_s` (None: the default group's).

    Collective on first use: every rank of the world must ask for the same groups in the same order.
    The cache lives as long as the process (zpp_compile.reset() keeps it): destroying and
    re-initialising the default process group in one process is not supported (group names would
    be reused).
    """
    key = (ranks, timeout_s)
    if key not in _GROUPS:
        group = dist.new_group(list(ranks), timeout=as_timedelta(timeout_s) or group_timeout(dist.group.WORLD))
        _GROUPS[key] = group.group_name if isinstance(group, dist.ProcessGroup) else None
        if _GROUPS[key] is not None and timeout_s is not None:
            _GROUP_TIMEOUTS[_GROUPS[key]] = timeout_s
    return _GROUPS[key]


def group_timeout_s(group_name: str) -> Optional[float]:
    """The Config.collective_timeout_s the group `group_name` was created with; None for groups
    that keep the default process group's timeout. Errors quote it for the group that failed."""
    return _GROUP_TIMEOUTS.get(group_name)


def group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The collective timeout of `group`. Read from the default group for new groups, which would
    otherwise get torch's built-in default (30 min on gloo), not the one init_process_group got."""
    for device in (torch.device("cuda"), torch.device("cpu")):  # whichever backend the group has
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # none for this device, or one without options
            continue
    return None  # torch's default applies


def _parse_local_world_size(raw: Optional[str]) -> Optional[int]:
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer; unset it or fix the launcher.") from None
    return value if value > 0 else None


_CURRENT: Topology | None = None


def set_current_topology(topology: Topology) -> None:
    """Remember the layout shard() used; every sharded model in a process must agree on it."""
    global _CURRENT
    if _CURRENT is not None and _node_layout(_CURRENT) != _node_layout(topology):
        raise ValueError(
            f"this process already sharded a model with {_CURRENT}, and now asks for {topology}; "
            "shard every model of a process with the same ranks_per_node."
        )
    _CURRENT = topology


def _node_layout(t: Topology) -> tuple:
    return (t.world_size, t.rank, t.ranks_per_node)  # hpz_size and group timeouts may differ per model


def current_topology() -> Topology:
    """The layout shard() used; before any shard(), the whole world as one node."""
    if _CURRENT is None:
        return build_topology(Config(), collective=False)
    return _CURRENT


@register_reset
def forget_current_topology() -> None:
    """For tests and re-initialised process groups: the next shard() sets the layout afresh."""
    global _CURRENT
    _CURRENT = None
