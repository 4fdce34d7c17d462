from __future__ import annotations

import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from zpp_compile.config import Config
from zpp_compile.passes import PassContext
from zpp_compile.topology import Topology


def trace(fn, *args) -> fx.GraphModule:
    """An ATen-level graph of fn with fake values in node.meta['val'], as AOTAutograd produces."""
    return make_fx(fn, tracing_mode="fake")(*args)


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def context(group_name: str, **config) -> PassContext:
    topology = Topology(world_size=1, rank=0, ranks_per_node=1, world_group_name=group_name)
    return PassContext(config=Config(**config), topology=topology, graph_id=0, phase="forward")
