"""Gradient accumulation without a reduce per micro-batch: zpp_compile.no_sync / set_requires_gradient_sync."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.grad_sync import pending_gradient_bytes

from .models import batch, build, gradient_errors, local_grad, loss_of, lowering_of

LOCAL_BATCH = 2
K = 4
RTOL = 1e-5
REDUCTIONS = ("reduce_scatter", "all_reduce", "all_to_all")


def accumulate(name: str, mode: str, use_no_sync: bool, steps: int = 2, reference: bool = False, **config) -> dict:
    """`steps` optimizer steps of K micro-batches each (no optimizer: gradients are compared), the
    first K-1 under no_sync when `use_no_sync`. Returns the gradient shards after each step, the
    backward collectives of each step, and (with `reference`) errors against an unsharded model
    that ran the same micro-batches on the global batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build(name)
    unsharded = copy.deepcopy(model) if reference else None
    zpp_compile.shard(model, zpp_compile.Config(lowering=lowering_of(mode), **config))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    counter = zpp_compile.comm_counter()
    result: dict = {"grads": [], "collectives": [], "errors": {}, "untouched": True, "pending_after_step": []}
    for step in range(steps):
        with counter.trace() as trace:
            for micro in range(K):
                x, y = batch(name, LOCAL_BATCH * world, step * K + micro)
                quiet = use_no_sync and micro < K - 1
                with zpp_compile.no_sync(model) if quiet else contextlib.nullcontext():
                    loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
                if quiet:  # accumulated in zpp_compile's buffers, p.grad untouched
                    result["untouched"] &= all(p.grad is None for p in model.parameters())
                if unsharded is not None:
                    loss_of(name, unsharded, x, y).backward()
        result["pending_after_step"].append(pending_gradient_bytes(model))
        result["grads"].append({n: local_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad})
        result["collectives"].append([(c.op, c.dtype, c.input_bytes) for c in trace if c.phase == "backward"])
        if unsharded is not None:
            result["errors"].update(gradient_errors(model, unsharded, step))
            unsharded.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return result


def compare_sync_and_no_sync(name: str, mode: str, config: dict | None = None) -> dict:
    config = config or {}
    sync = accumulate(name, mode, False, **config)
    quiet = accumulate(name, mode, True, **config)
    errors = {}
    for step, (a, b) in enumerate(zip(sync["grads"], quiet["grads"])):
        scale = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in a.values()])).item()
        for n in a:
            errors[f"step {step} {n}"] = (a[n] - b[n]).norm().item() / scale
    return {"errors": errors, "sync": sync["collectives"], "no_sync": quiet["collectives"],
            "untouched": quiet["untouched"], "pending": quiet["pending_after_step"]}  # fmt: skip


def _reduced_bytes(collectives: list) -> int:
    return sum(nbytes for op, _, nbytes in collectives if op in REDUCTIONS)


def _check(results: list[dict], rtol: float = RTOL) -> None:
    for rank, result in enumerate(results):
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= rtol, f"rank {rank}: {worst} differs by {result['errors'][worst]:.2e}"
        assert result["untouched"], "p.grad must stay untouched under no_sync"
        assert result["pending"] == [0, 0], "the synchronised backward frees every buffer"
        for sync, quiet in zip(result["sync"], result["no_sync"]):
            # K reductions of every gradient against one: 1/K of the bytes, the same collectives.
            assert _reduced_bytes(sync) == K * _reduced_bytes(quiet) > 0
            assert {c[:2] for c in sync} == {c[:2] for c in quiet}


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_no_sync_gradients_equal_synchronous_accumulation_with_1_over_k_of_the_bytes(pools, mode):
    # OddMLP: uneven shards, a frozen layer and a 0-d replicated scale (all_reduce_grad).
    _check(pools(2).run(compare_sync_and_no_sync, "mlp", mode))


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_no_sync_under_activation_checkpointing_accumulates_once(pools, mode):
    # The backward recomputes the forward (gathers included) but runs once per micro-batch: each
    # gradient is added to its buffer once (twice would show as a gradient error here).
    _check(pools(2).run(compare_sync_and_no_sync, "ckpt_mlp", mode))


def test_no_sync_gpt_with_tied_weights_compiled(pools):
    _check(pools(2).run(compare_sync_and_no_sync, "gpt", "inductor"))


def test_no_sync_with_graph_breaks_inside_the_loop_over_blocks(pools):
    # The graph Dynamo reuses for every block is specialised per block under no_sync (the
    # parameter's name keys its buffer): more compiles, the same gradients.
    _check(pools(2).run(compare_sync_and_no_sync, "break_gpt", "aot_eager"))


def test_no_sync_under_hpz_qwz_and_mixed_precision(pools):
    """Two nodes of two: int8 forward gathers, int8 secondary shards, bf16 compute, fp32 reduce:
    the buffers hold fp32 gradients, and the same forward runs in both paths."""
    config = dict(
        ranks_per_node=2, hpz_size=2, quantize_weights=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    _check(pools(4).run(compare_sync_and_no_sync, "mlp", "aot_eager", config))


def qgz_no_sync() -> dict:
    config = dict(ranks_per_node=2, quantize_gradients=True, gradient_block_size=64)
    sync = accumulate("gpt", "aot_eager", False, reference=True, **config)
    quiet = accumulate("gpt", "aot_eager", True, reference=True, **config)
    return {"sync": sync, "no_sync": quiet}


def test_no_sync_under_qgz_reduces_once_in_int4(pools):
    for rank, result in enumerate(pools(4).run(qgz_no_sync)):
        sync, quiet = result["sync"], result["no_sync"]
        for step in range(2):
            ops = {(op, dtype) for op, dtype, _ in quiet["collectives"][step] if op in REDUCTIONS}
            assert ops == {("all_to_all", torch.uint8)}, ops  # int4 payloads, no float reduction
            calls = sum(1 for op, _, _ in quiet["collectives"][step] if op == "all_to_all")
            assert calls * K == sum(1 for op, _, _ in sync["collectives"][step] if op == "all_to_all") == 2 * K
            assert _reduced_bytes(sync["collectives"][step]) == K * _reduced_bytes(quiet["collectives"][step])
        # Against the unsharded model: the qgZ tolerance of test_mixed_precision (one int4 reduction).
        for label in ("sync", "no_sync"):
            worst = max(result[label]["errors"].values())
            assert worst <= 0.1, (rank, label, worst)
        assert quiet["untouched"] and quiet["pending_after_step"] == [0, 0]


def toggled_back() -> dict:
    """no_sync for a micro-batch, then sync training: the second step reduces its own gradient
    only (no stale buffer); a checkpoint save while gradients are pending is refused."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build("mlp")
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, zpp_compile.Config())
    run = torch.compile(model, backend="zeropp")
    x, y = batch("mlp", LOCAL_BATCH * world, 0)
    mine = x.chunk(world)[rank], y.chunk(world)[rank]
    with zpp_compile.no_sync(model):
        loss_of("mlp", run, *mine).backward()
    refused = ""
    try:
        zpp_compile.save_checkpoint("/nonexistent/never_written", model)
    except zpp_compile.PendingGradientsError as error:
        refused = str(error)
    loss_of("mlp", run, *mine).backward()  # flush: both micro-batches
    for _ in range(2):
        loss_of("mlp", reference, x, y).backward()
    errors = gradient_errors(model, reference, 0)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    counter = zpp_compile.comm_counter()
    for step in (1, 2):  # plain synchronous steps: one micro-batch, one reduction each
        x, y = batch("mlp", LOCAL_BATCH * world, step)
        counter.reset()
        loss_of("mlp", run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        loss_of("mlp", reference, x, y).backward()
        errors.update(gradient_errors(model, reference, step))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    zpp_compile.set_requires_gradient_sync(model, True)  # already synchronised: a no-op
    return {"errors": errors, "refused": refused, "mode": model._zpp_state.grad_sync,
            "reduce_scatters": counter.calls(phase="backward", op="reduce_scatter")}  # fmt: skip


def test_sync_toggled_back_trains_without_stale_buffers_and_checkpoints_refuse_pending(pools):
    for result in pools(2).run(toggled_back):
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= RTOL, worst
        assert "no_sync" in result["refused"] and "5 parameters" in result["refused"]
        assert result["mode"] == "sync"
        assert result["reduce_scatters"] > 0
