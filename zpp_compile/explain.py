"""explain(): the communication plan of one training step, as the compiled model issues it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .comm import comm_counter
from .plan import CommPlan
from .sharding import sharded_state, unwrap_compiled


def explain(model: nn.Module, *inputs: Any, **kwargs: Any) -> CommPlan:
    """Run one forward and backward of `model` on `inputs` and return every collective it issued.

    `model` is a sharded model, compiled with backend="zeropp" or not (then it is compiled here).
    The backward runs on the output if it is a scalar loss, else on the sum of the output.
    Parameter gradients are restored afterwards, so a training loop is not disturbed. Like a
    training step it is collective: every rank must call it with inputs of the same shapes.

    Under Config(plan="auto") the result also holds the plan chosen for each graph compiled so
    far, with the estimated time, bytes and memory of every option weighed; `print()` shows them.
    Under it, without inputs nothing runs: only those plans are returned (no collective, any rank).
    """
    original = unwrap_compiled(model)
    state = sharded_state(original)
    if not inputs and not kwargs and state.config.auto_plan:
        return CommPlan([], state.topology, list(state.auto_plans))
    compiled = model if original is not model else torch.compile(model, backend="zeropp")
    params = list(original.parameters())
    saved_grads = [p.grad for p in params]
    with comm_counter().trace() as collectives:
        out = compiled(*inputs, **kwargs)
        loss = out if isinstance(out, torch.Tensor) and out.numel() == 1 else _sum_of_tensors(out)
        if loss.requires_grad:
            loss.backward()
    for p, g in zip(params, saved_grads):
        p.grad = g
    return CommPlan(list(collectives), state.topology, list(state.auto_plans))


def _sum_of_tensors(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("explain() needs the model to return at least one floating-point tensor to backpropagate.")
    return sum(t.float().sum() for t in leaves)
