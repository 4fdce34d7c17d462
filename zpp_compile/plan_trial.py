"""Config(plan="auto", plan_trial_steps=N): time the options the estimate cannot tell apart.

On a CPU the estimate misses gloo's copies and the quantize kernels competing with the compute
for the cores, and ranks options within a few percent in the wrong order (docs/auto_plan.md).
Where the best options of several sets of techniques tie (auto_plan.trial_candidates), the
backend compiles the training graph once per candidate and hands Dynamo a PlanTrial instead of
one compiled function. Each call runs one candidate, in turn: N + 1 calls each, the first a warm-up.
A call's step is the time from its start to the next call's start (the whole training step: this
graph, the others, the optimizer). After the last candidate's calls, the ranks agree on each
candidate's median step (the slowest rank's, an all-reduce on the world group) and every later
call runs the fastest; the others' compiled code is dropped.

Each candidate's forward returns tensors whose backward is that candidate's (AOTAutograd pairs
them), so switching between calls is safe. Every rank calls its graphs in the same order, so
every rank runs the same candidate at each call and reaches the agreement at the same call.
Graphs of one model are timed one at a time (ShardedState.plan_trials, in compile order): while
one is timed the others run their first candidate, so each measured step differs in one graph only.

What a trial keeps is remembered next to the measured rates (in Inductor's cache folder), by the
Config, the graph's parameters and the candidates (auto_plan.trial_key). A later run whose graph
weighs the same candidates takes it without timing again (no extra compiles), if every rank
remembers the same (shard() compares the ranks' files with one all-reduce; where they differ,
every rank times afresh).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .agreement import all_equal, digest
from .auto_plan import AutoPlan, trial_key
from .cost_model import rates_folder, resolve_group, write_json_atomically
from .faults import explained_collective_failures
from .layout import ShardedState


class PlanTrial:
    """One graph's candidates (plans[0] the estimate's choice), run in turn, then the fastest."""

    def __init__(self, plans: list[AutoPlan], compiled: list[Callable], state: ShardedState, device: torch.device):
        self.plans, self.compiled, self.state, self.device = plans, compiled, state, device
        self.steps = state.config.plan_trial_steps
        self.calls = 0
        self.last_start: Optional[float] = None
        self.seconds: list[list[float]] = [[] for _ in plans]  # per candidate, its timed steps
        self.winner: Optional[int] = None
        state.plan_trials.append(self)

    def __call__(self, *args: Any) -> Any:
        if self.winner is not None:
            return self.compiled[self.winner](*args)
        if self.state.plan_trials[0] is not self:  # another graph is being timed: wait with the first
            return self.compiled[0](*args)
        now = self._now()
        if self.last_start is not None:
            timed = (self.calls - 1) % (self.steps + 1)  # 0: the previous call was a warm-up
            if timed:
                self.seconds[(self.calls - 1) // (self.steps + 1)].append(now - self.last_start)
        if self.calls == len(self.plans) * (self.steps + 1):
            self._settle()
            return self.compiled[self.winner](*args)
        self.last_start = now
        candidate = self.calls // (self.steps + 1)
        self.calls += 1
        return self.compiled[candidate](*args)

    def _now(self) -> float:
        if self.device.type == "cuda":  # the step ends when its kernels do
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _settle(self) -> None:
        """Every rank keeps the candidate whose median step, on the slowest rank, was shortest."""
        # On the device: NCCL groups take CUDA tensors only.
        medians = torch.tensor([statistics.median(s) for s in self.seconds], dtype=torch.float64, device=self.device)
        topology = self.state.topology
        where = f"the plan trial of {self.plans[0].label} (Config.plan_trial_steps)"
        with explained_collective_failures(where, topology.collective_timeout_s):
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=resolve_group(topology.world_group_name))
        slowest = medians.tolist()
        self.winner = min(range(len(slowest)), key=slowest.__getitem__)
        settled(self.state, self.plans, slowest, self.winner)
        remember_kept(self.state, self.plans[0], self.plans[self.winner], self.device)
        self.compiled = [c if i == self.winner else None for i, c in enumerate(self.compiled)]
        self.state.plan_trials.remove(self)


def settled(state: ShardedState, plans: list[AutoPlan], seconds: list[float], winner: int) -> None:
    """Record the timings on the winning plan and make it the graph's plan: what explain() prints
    and what a later recompile of the same graph takes (auto_plan.choose_plan)."""
    timed = dict(zip((p.chosen.option for p in plans), seconds))
    plan = plans[winner]
    plan.trial_seconds = timed
    first = plans[0]
    at = next(i for i, p in enumerate(state.auto_plans) if p is first)
    state.auto_plans[at] = plan
    plan.label = first.label


def kept_plans_file(state: ShardedState, device: torch.device) -> Path:
    """Where the plans trials kept are remembered: beside the rates (cost_model.rates_file)."""
    topology = state.topology
    return rates_folder() / f"plan-trials-world{topology.world_size}-nodes{topology.num_nodes}-{device.type}.json"


def _read_kept(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time afresh
        return {}
    ok = isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in data.items())
    return data if ok else {}


def agreed_kept_plans(state: ShardedState, device: torch.device) -> dict[str, str]:
    """shard() (collective): what earlier trials kept, as this rank's file says, if every rank's says
    the same (agreement.all_equal); else nothing (every rank then times its candidates)."""
    kept = _read_kept(kept_plans_file(state, device))
    return kept if all_equal(digest(sorted(kept.items()))) else {}


def remember_kept(state: ShardedState, first: AutoPlan, kept: AutoPlan, device: torch.device) -> None:
    """Add what this trial kept to the file (one rank per node writes it: the ranks agree)."""
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) != 0:
        return
    path = kept_plans_file(state, device)
    remembered = _read_kept(path)
    remembered[trial_key(state.config, first.key, first.candidates)] = kept.chosen.option.name
    write_json_atomically(path, remembered)
