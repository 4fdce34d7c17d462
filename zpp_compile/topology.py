"""Which ranks share a node: the world group and the node layout, derived identically on every rank."""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from .config import Config


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
    """World size, this rank, and how ranks map to nodes (node = rank // ranks_per_node)."""

    world_size: int
    rank: int
    ranks_per_node: int
    world_group_name: str

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)


def build_topology(config: Config) -> Topology:
    """Read the layout from Config.ranks_per_node, else torchrun's LOCAL_WORLD_SIZE, else one node."""
    require_initialized("zpp_compile.shard")
    world = dist.get_world_size()
    ranks_per_node = config.ranks_per_node or _local_world_size_from_env() or world
    if world % ranks_per_node:
        raise ValueError(
            f"world size {world} is not a multiple of ranks_per_node={ranks_per_node}: every node "
            "must hold the same number of ranks. Set Config(ranks_per_node=...) to a divisor of "
            f"{world}, or launch the same --nproc-per-node on every node."
        )
    return Topology(
        world_size=world,
        rank=dist.get_rank(),
        ranks_per_node=ranks_per_node,
        world_group_name=dist.group.WORLD.group_name,
    )


def _local_world_size_from_env() -> int | None:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
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
    if _CURRENT is not None and _CURRENT != topology:
        raise ValueError(
            f"this process already sharded a model with {_CURRENT}, and now asks for {topology}; "
            "shard every model of a process with the same ranks_per_node."
        )
    _CURRENT = topology


def current_topology() -> Topology:
    """The layout shard() used; before any shard(), the whole world as one node."""
    if _CURRENT is None:
        return build_topology(Config())
    return _CURRENT


def forget_current_topology() -> None:
    """For tests and re-initialised process groups: the next shard() sets the layout afresh."""
    global _CURRENT
    _CURRENT = None
