"""The schedule check: ranks about to issue different collectives, or the same collectives for
different parameters, fail together with an error naming the parameter; a correct program where
ranks run different graphs with the same collectives (one rank recompiled) is never blocked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zpp_compile
from zpp_compile.schedule_check import Schedule, ScheduledCollective, ScheduleMismatchError, describe_mismatch

from .models import batch, build, loss_of
from .workers import reset_process_state


class BranchingMLP(nn.Module):
    """Two layers of the same shape; the data chooses which one runs (as a rank-dependent branch
    does): gathering fc_a on one rank and fc_b on another pairs two different weights."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(8, 8)
        self.fc_b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.fc_a if x.sum() > 0 else self.fc_b  # data-dependent: a graph break when compiled
        return self.head(torch.relu(layer(x)))


def branching(mode: str, check: object) -> str:
    torch.manual_seed(0)
    model = zpp_compile.shard(BranchingMLP(), zpp_compile.Config(check_schedule=check, lowering="aot_eager"))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    x = torch.ones(2, 8) * (1 if dist.get_rank() == 0 else -1)  # rank 0 takes fc_a, rank 1 fc_b
    try:
        run(x).sum().backward()
    except ScheduleMismatchError as error:
        return str(error)
    finally:
        reset_process_state()
    return "no error"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("check", [True, zpp_compile.Config().check_schedule], ids=["every_run", "default"])
def test_ranks_gathering_different_parameters_of_one_shape_are_named(pools, mode, check):
    messages = pools(2).run(branching, mode, check)
    assert messages[0] == messages[1], messages  # every rank raises, with the same message
    assert "'fc_a.weight'" in messages[0] and "'fc_b.weight'" in messages[0], messages[0]
    assert "on rank 0" in messages[0] and "on rank 1" in messages[0]
    assert "avoid rank-dependent control flow" in messages[0]


def uneven_last_batch(check: object) -> list[float]:
    """Rank 0's last batch is shorter: it recompiles while rank 1 reuses its graph. The two
    graphs issue the same collectives, so the run is correct and must not block."""
    torch.manual_seed(0)
    config = zpp_compile.Config(check_schedule=check, lowering="aot_eager", collective_timeout_s=60)
    model = zpp_compile.shard(build("gpt"), config)
    compiled = torch.compile(model, backend="zeropp")
    losses = []
    for step in range(3):
        x, y = batch("gpt", 4, step)
        rows = 1 if step == 2 and dist.get_rank() == 0 else 2
        loss = loss_of("gpt", compiled, x[:rows], y[:rows])
        loss.backward()
        losses.append(loss.item())
    reset_process_state()
    return losses


def test_a_rank_that_recompiles_alone_is_not_blocked_by_the_check(pools):
    checked = pools(2).run(uneven_last_batch, True, timeout_s=240)
    unchecked = pools(2).run(uneven_last_batch, False, timeout_s=240)
    assert checked == unchecked


def test_mismatch_description_names_the_parameter_and_a_missing_collective():
    a = ScheduledCollective("gather", 2, "float32", 16, ("fc.weight",))
    b = ScheduledCollective("gather", 2, "float32", 16, ("fc2.weight",))
    message = describe_mismatch([Schedule("graph0_forward", (a,)), Schedule("graph0_forward", (a, a))])
    assert "collective #1 is absent (the graph has ended) on rank 0" in message
    message = describe_mismatch([Schedule("g", (a,)), Schedule("g", (b,))])
    assert "gather of 'fc.weight'" in message and "gather of 'fc2.weight'" in message
    assert describe_mismatch([Schedule("g", (a,)), Schedule("g", (a,))]) is None
