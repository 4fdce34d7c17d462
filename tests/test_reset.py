"""zpp_compile.reset() clears every piece of process-global state, and one registration adds more."""

from __future__ import annotations

import pytest
import torch

import zpp_compile
from zpp_compile.layout import shard_spec, sharded_state

from .models import OddMLP


def _registries() -> dict:
    """How much each module's process-global state holds (0 / None / empty: clean)."""
    from zpp_compile import backend, error_feedback, grad_sync, schedule_check, sharding, topology

    return {
        "compiled graph records": len(backend._RECORDS),
        "comm counter calls": zpp_compile.comm_counter().calls(),
        "current topology": topology._CURRENT,
        "error feedback errors": len(error_feedback._ERRORS),
        "error feedback backward tasks": len(error_feedback._STORED_IN),
        "error feedback slot numbering": len(error_feedback._SLOT_OF),
        "no_sync gradient buffers": len(grad_sync._BUFFERS),
        "sharded classes": len(sharding._SHARDED_CLASSES),
        "checked runs": (schedule_check.CHECKED_RUNS.done, schedule_check.CHECKED_RUNS.limit),
    }


CLEAN = {
    "compiled graph records": 0,
    "comm counter calls": 0,
    "current topology": None,
    "error feedback errors": 0,
    "error feedback backward tasks": 0,
    "error feedback slot numbering": 0,
    "no_sync gradient buffers": 0,
    "sharded classes": 0,
    "checked runs": (0, 0),
}


def _step(compiled, x: torch.Tensor) -> None:
    compiled(x).square().mean().backward()


def fill_then_reset() -> dict:
    """A qgZ model with error feedback trains a synchronised step, then one under no_sync (buffers
    pending); every registry holds something; reset() empties them all."""
    zpp_compile.reset()  # whatever an earlier task left
    before = _registries()
    torch.manual_seed(0)
    model = OddMLP()
    config = zpp_compile.Config(ranks_per_node=1, quantize_gradients=True, qgz_error_feedback=True,
                                gradient_block_size=32, lowering="aot_eager")  # fmt: skip
    zpp_compile.shard(model, config)
    plan_id = sharded_state(model).plan_id
    compiled = torch.compile(model, backend="zeropp")
    x = torch.randn(4, 13)
    _step(compiled, x)
    with zpp_compile.no_sync(model):
        _step(compiled, x)
    filled = _registries()
    modes = [sharded_state(model).grad_sync]  # "flush": buffers pending for the next backward
    zpp_compile.reset()
    after = _registries()
    modes.append(sharded_state(model).grad_sync)

    # After reset(): the same model recompiles (Dynamo's caches are gone too), a new model gets a
    # plan id of its own, and the next shard() may choose another node layout.
    compiled(x)
    recompiled = len(zpp_compile.compiled_graphs())
    zpp_compile.reset()
    other = OddMLP()
    zpp_compile.shard(other, zpp_compile.Config(ranks_per_node=2, lowering="aot_eager"))
    return {"before": before, "filled": filled, "after": after, "modes": modes,
            "recompiled": recompiled, "plan_ids": (plan_id, sharded_state(other).plan_id)}  # fmt: skip


def test_reset_clears_every_registry(pools):
    for rank, result in enumerate(pools(2).run(fill_then_reset)):
        assert result["before"] == CLEAN, f"rank {rank}"
        still_clean = [name for name, value in result["filled"].items() if value == CLEAN[name]]
        assert still_clean == [], f"rank {rank}: the step left no state in {still_clean}: the test misses them"
        assert result["after"] == CLEAN, f"rank {rank}"
        assert result["modes"] == ["flush", "sync"], "no gradients pending: the next backward reduces its own"
        assert result["recompiled"] == 1, "the forward compiled anew after reset()"
        first, second = result["plan_ids"]
        assert second > first, "plan ids keep counting: no model shares state with an earlier one"


def test_register_reset_adds_a_clear_function_once():
    from zpp_compile import process_state

    state = {"n": 1}

    def clear() -> None:
        state["n"] = 0

    try:
        assert process_state.register_reset(clear) is clear
        process_state.register_reset(clear)
        assert process_state._CLEARS.count(clear) == 1
        zpp_compile.reset()
        assert state["n"] == 0
    finally:
        process_state._CLEARS.remove(clear)


def errors_quote_their_groups_timeout() -> list[str]:
    """Two models with different collective timeouts: an eager collective's error quotes the
    timeout of the group it ran on, not the latest shard()'s."""
    from zpp_compile.rooted_ops import explained_failures_in

    messages = []
    models = []
    for timeout_s in (71.0, 93.0):
        model = OddMLP()
        zpp_compile.shard(model, zpp_compile.Config(collective_timeout_s=timeout_s, lowering="aot_eager"))
        models.append(model)
    for model in models:
        group_name = shard_spec(model.fc1.weight).group_name
        with pytest.raises(zpp_compile.CollectiveError) as caught:
            with explained_failures_in("the eager all-gather of a parameter", group_name):
                raise RuntimeError("Connection closed by peer")
        messages.append(str(caught.value))
    return messages


def test_eager_collective_errors_quote_their_groups_timeout(pools):
    for messages in pools(2).run(errors_quote_their_groups_timeout):
        assert "collective_timeout_s=71)" in messages[0], messages[0]
        assert "collective_timeout_s=93)" in messages[1], messages[1]
