from __future__ import annotations

import ast
import os
import subprocess
import sys

import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from zpp_compile.config import Config
from zpp_compile.cost_model import CostModel
from zpp_compile.passes import PassContext
from zpp_compile.topology import Topology


def trace(fn, *args) -> fx.GraphModule:
    """An ATen-level graph of fn with fake values in node.meta['val'], as AOTAutograd produces."""
    return make_fx(fn, tracing_mode="fake")(*args)


def gathering_layers(group: str, layers: int = 3) -> tuple[fx.GraphModule, tuple]:
    """x -> `layers` linear layers (tanh) whose 64 x 64 weights are gathered (zpp.gather_param
    markers, one per layer), traced; with example inputs (x, then one shard per layer)."""
    import torch

    def forward(x, *shards):
        for shard in shards:
            x = torch.tanh(x @ torch.ops.zpp.gather_param(shard, 64 * 64, [64, 64], 64 * 64, 1, group).t())
        return x

    args = (torch.randn(8, 64), *(torch.randn(4096) for _ in range(layers)))
    return trace(forward, *args), args


def gathered_layers(group: str, layers: int = 3) -> tuple[fx.GraphModule, tuple]:
    """gathering_layers lowered: one functional all-gather per layer."""
    from zpp_compile.passes import lower_gather

    gm, args = gathering_layers(group, layers)
    return lower_gather(gm, context(group)), args


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def context(
    where: str | Topology, *, phase: str = "forward", cost_model: CostModel | None = None, **config
) -> PassContext:
    """What a pass receives, for graph 0 in `phase`: `where` is a Topology, or the group name of a
    one-rank world; Config(**config)."""
    if isinstance(where, str):
        where = Topology(world_size=1, rank=0, ranks_per_node=1, world_group_name=where)
    return PassContext(config=Config(**config), topology=where, graph_id=0, phase=phase, cost_model=cost_model)


def call_targets_with_triton_kernels(script: str) -> list[str]:
    """Run `script` (which prints a list of call target names last) in a fresh process with the
    Triton kernel set: tracing a Triton kernel needs the compiled (not interpreted) Triton
    frontend, and this test session runs Triton interpreted when there is no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ZPP_QUANT_KERNELS"] = "triton"  # what a CUDA tensor gets without the override
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])
