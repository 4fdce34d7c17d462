"""The communication plan of compiled graphs: which collectives they issue, on which group, how big."""

from __future__ import annotations

import dataclasses
import operator
from typing import Container, Iterable, Optional

import torch
import torch.fx as fx

from .comm import Collective, Phase, group_ranks
from .passes.buckets import tensor_bytes
from .passes.graph_utils import COLLECTIVE_OPS, shares_input_storage
from .passes.tag_parameter_inputs import PARAM_INPUT
from .schedule_check import ScheduledCollective, input_placeholder
from .topology import Topology


def collectives_in(gm: fx.GraphModule, phase: Phase, label: str) -> list[Collective]:
    """Every functional collective in `gm`, in graph order, with its payload as this rank sends it."""
    found = []
    for node in gm.graph.nodes:
        op = COLLECTIVE_OPS.get(node.target) if node.op == "call_function" else None
        if op is None:
            continue
        payload = node.args[0].meta["val"]
        group_name = node.args[-1]
        ranks = group_ranks(group_name)
        # A reduce-scatter's input, as the functional form sends it: the rooted one may take it
        # without its zero pad (root_large_collectives).
        numel = node.meta["val"].numel() * len(ranks) if op == "reduce_scatter" else payload.numel()
        found.append(
            Collective(
                op=op,
                phase=phase,
                group_name=group_name,
                group_ranks=ranks,
                dtype=payload.dtype,
                input_numel=numel,
                label=label,
            )
        )
    return found


_zpp = torch.ops.zpp
# Marker -> (name in schedules, index of its element count argument or None for arg 0's numel).
_MARKERS = {
    _zpp.gather_param.default: ("gather", 1),
    _zpp.gather_quantized_param.default: ("gather_int8", 1),
    _zpp.replicated_param.default: ("replicated", None),
    _zpp.reduce_grad.default: ("reduce", 1),
    _zpp.all_reduce_grad.default: ("all_reduce", None),
}


def marker_schedule(gm: fx.GraphModule, named: bool = True) -> list[ScheduledCollective]:
    """The parameters a graph gathers and reduces, in graph order: read off the markers before
    they are lowered (afterwards collectives carry buckets, not parameters). `named`: with the
    parameters' graph input positions, named when the graph runs (forward and inference graphs:
    a backward graph runs after its forward call, with nothing to name them by; it follows from
    the forward, which the check already compared)."""
    entries = []
    for node in gm.graph.nodes:
        kind = _MARKERS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        name, numel_arg = kind
        value = node.args[0].meta["val"]
        numel = node.args[numel_arg] if numel_arg is not None else value.numel()
        dtype = str(node.kwargs.get("dtype") or value.dtype).removeprefix("torch.")
        group_size = len(group_ranks(node.args[-1]))
        params = (_parameter_of(node),) if named else ()
        entries.append(ScheduledCollective(name, group_size, dtype, numel, params))
    return entries


def _parameter_of(marker: fx.Node) -> str:
    """The marker's parameter as the schedule check names it: a graph input position, resolved to
    the name of the parameter passed there when the graph runs (tag_parameter_inputs)."""
    position = marker.meta.get("custom", {}).get(PARAM_INPUT)
    return input_placeholder(position) if position is not None else marker.kwargs.get("fqn", "")


def as_scheduled(collective: Collective) -> ScheduledCollective:
    """A collective of a final graph as the schedule check compares it."""
    return ScheduledCollective(
        collective.op, len(collective.group_ranks), str(collective.dtype).removeprefix("torch."), collective.input_numel
    )


def peak_collective_bytes(gm: fx.GraphModule, ops: Optional[Container[str]] = None) -> int:
    """The most bytes of collective results alive at once when `gm` runs in graph order.

    A result lives from its collective's start to the last use of it or of any view of it (the
    buffer cannot be freed while a view survives): the gathered weights and buckets in flight and
    in use, which is what bucketing and prefetch trade against step time. `ops`: only those
    collectives ("all_gather", "reduce_scatter", "all_to_all", "all_reduce").
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    spans = [
        (position[n], _last_use(n, position), n.meta["val"].numel() * n.meta["val"].element_size())
        for n in nodes
        if n.op == "call_function" and n.target in COLLECTIVE_OPS and (ops is None or COLLECTIVE_OPS[n.target] in ops)
    ]
    return max((sum(size for lo, hi, size in spans if lo <= i <= hi) for i in range(len(nodes))), default=0)


def weights_gathered_from_inputs(gm: fx.GraphModule, group_name: str) -> int:
    """Bytes of the graph inputs that an all-gather over `group_name` reads: in a backward graph
    and hpZ's group, the secondary shards the forward handed over (Config.hpz_parameters may leave
    other weights to be gathered from their primary shards over the world)."""
    gathered = [
        n.args[0]
        for n in gm.graph.nodes
        if n.op == "call_function" and COLLECTIVE_OPS.get(n.target) == "all_gather" and n.args[-1] == group_name
    ]
    return sum(tensor_bytes(n) for n in _placeholders_behind(gathered))


def _placeholders_behind(nodes: list[fx.Node]) -> set[fx.Node]:
    """The graph inputs values are computed from (through a bucket's flatten, pad and concat)."""
    found, todo, seen = set(), list(nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        todo.extend(n.all_input_nodes)
    return found


def _last_use(node: fx.Node, position: dict[fx.Node, int]) -> int:
    last = position[node]
    for user in node.users:
        last = max(last, _last_use(user, position) if _aliases_input(user) else position[user])
    return last


def _aliases_input(node: fx.Node) -> bool:
    """Whether `node` hands on its input's buffer: a view, a wait, or an item of a list result."""
    return shares_input_storage(node) or (node.op == "call_function" and node.target is operator.getitem)


@dataclasses.dataclass
class CommPlan:
    """The collectives of one training step as this rank issues them, in order; under
    Config(plan="auto") also the plan chosen for each compiled graph (auto_plan.AutoPlan), first
    in the printout."""

    collectives: list[Collective]
    topology: Topology
    auto_plans: list = dataclasses.field(default_factory=list)

    def bytes(self, *, phase: Phase | None = None, op: str | None = None, locality: str | None = None) -> int:
        total = 0
        for c in self._select(phase, op):
            split = c.bytes_by_locality(self.topology)
            total += split[locality] if locality else sum(split.values())
        return total

    def count(self, *, phase: Phase | None = None, op: str | None = None) -> int:
        return sum(1 for _ in self._select(phase, op))

    def _select(self, phase: Phase | None, op: str | None) -> Iterable[Collective]:
        return (c for c in self.collectives if phase in (None, c.phase) and op in (None, c.op))

    def __str__(self) -> str:
        plans = [str(p) for p in self.auto_plans]
        return "\n\n".join([*plans, self._collectives_table()]) if self.collectives or not plans else "\n\n".join(plans)

    def _collectives_table(self) -> str:
        header = f"{'graph':<22} {'collective':<15} {'group':>6} {'dtype':<9} {'input bytes':>12} {'intra sent':>11} {'inter sent':>11}"
        rows = [header]
        for c in self.collectives:
            split = c.bytes_by_locality(self.topology)
            rows.append(
                f"{c.label:<22} {c.op:<15} {len(c.group_ranks):>6} {str(c.dtype).removeprefix('torch.'):<9} "
                f"{c.input_bytes:>12} {split['intra']:>11} {split['inter']:>11}"
            )
        rows.append(f"total sent per rank: {self.bytes()} bytes ({self.bytes(locality='inter')} inter-node)")
        return "\n".join(rows)
