"""What every pass receives besides the graph: the config, the layout and where to dump graphs."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch.fx as fx

from ..compile_timing import StageSeconds
from ..config import Config
from ..cost_model import CostModel
from ..topology import Topology


@dataclasses.dataclass
class PassContext:
    config: Config
    topology: Topology
    graph_id: int
    phase: str = "dynamo"  # "dynamo" | "joint" | "partitioned" | "forward" | "backward" | "inference"
    cost_model: Optional[CostModel] = None  # None: the scheduling passes leave the order alone
    plan_id: int = -1  # the shard() call whose model this graph belongs to (qgZ's error slots)
    # The names of the parameters the Dynamo graph was compiled for, in input order: what its
    # error slots are keyed by (a recompile of the same region names the same ones).
    parameter_names: tuple[str, ...] = ()
    # The Dynamo graph input positions of those parameters (what markers record: see
    # tag_parameter_inputs), in the same order.
    parameter_positions: tuple[int, ...] = ()
    # The decomposition table of the lowering, for passes that trace torch code into the graph.
    decompositions: dict = dataclasses.field(default_factory=dict)
    # Seconds per compile stage of this graph, shared by every phase's context (for_phase).
    stage_seconds: StageSeconds = dataclasses.field(default_factory=StageSeconds)
    # Config(plan="auto", plan_trial_steps=N): the option (auto_plan.Option) this compile is a
    # trial candidate of; None: the plan chooses.
    plan_option: Optional[object] = None
    _dump_step: int = 0

    @property
    def label(self) -> str:
        return f"graph{self.graph_id}_{self.phase}"

    def dump(self, gm: fx.GraphModule, stage: str) -> Optional[str]:
        """Write gm.print_readable() to <dump dir>/rank<r>/<graph>_<NN>_<stage>.txt when dumping is on."""
        folder = self.config.graph_dump_dir
        if folder is None:
            return None
        folder = os.path.join(folder, f"rank{self.topology.rank}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{self.label}_{self._dump_step:02d}_{stage}.txt")
        self._dump_step += 1
        with open(path, "w") as f:
            f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))
        return path

    def for_phase(self, phase: str) -> PassContext:
        return dataclasses.replace(self, phase=phase, _dump_step=0)
