"""Mixed precision (Config.param_dtype / reduce_dtype): fp32 master shards, bf16 wire and compute.

The reference is single-process: a bf16 copy of fp32 master weights runs forward and backward on
the global batch, its gradients step the fp32 masters. The sharded run must match it to bf16
accuracy, move bf16 on every gather, and reduce in reduce_dtype; and the masters, gradients and
optimizer state it keeps must stay fp32.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.sharding import shard_spec

from .models import batch, build, gradient_errors, loss_of, lowering_of, sharded_with_reference

LOCAL_BATCH = 2
# bf16 keeps 8 significant bits: one rounding is 2^-9 ~ 2e-3 relative; a forward and backward
# through a few layers, summed over ranks in bf16, lands well inside 3e-2 of the gradient norm.
BF16_GRAD_RTOL = 3e-2


def _bf16_reference_grads(name: str, master: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward/backward of a bf16 copy of the masters on the global batch; the grads go on the masters.
    Parameters only are cast, as in the sharded run: buffers keep their dtype."""
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    x = x.to(torch.bfloat16) if x.is_floating_point() else x
    loss = loss_of(name, compute, x, y)
    loss.backward()
    for p_master, p in zip(master.parameters(), compute.parameters()):
        if p.grad is not None:
            p_master.grad = p.grad.float()


def train_mixed_precision(name: str, mode: str, reduce_dtype, steps: int = 3, config: Optional[dict] = None) -> dict:
    """Train sharded with param_dtype=bf16 and, alongside, the single-process bf16/fp32 reference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mp = zpp_compile.Config(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, lowering=lowering_of(mode), **(config or {})
    )
    model, run, opt, master, ref_opt = sharded_with_reference(name, mode, mp)
    errors = {}
    with zpp_compile.comm_counter().trace() as collectives:
        for step in range(steps):
            x, y = batch(name, LOCAL_BATCH * world, step)
            loss = loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank])
            loss.backward()
            _bf16_reference_grads(name, master, x, y)
            errors.update(gradient_errors(model, master, step))
            grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
    states = [s for state in opt.state.values() for s in state.values() if s.dim() > 0]
    return {
        "errors": errors,
        "grad_dtypes": grad_dtypes,
        "kept_dtypes": {t.dtype for t in [*model.parameters(), *states]},
        "wire": {(c.op, c.dtype) for c in collectives},
        "params": {k: v for k, v in zpp_compile.full_state_dict(model).items()},
        "reference": master.state_dict(),
    }


def _check(
    results: list[dict], wire: set, grad_rtol: float = BF16_GRAD_RTOL, param_rtol: Optional[float] = 1e-2
) -> None:
    for rank, result in enumerate(results):
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= grad_rtol, f"rank {rank}: {worst} off by {result['errors'][worst]:.2e}"
        assert result["grad_dtypes"] == {torch.float32}, "gradients land on the fp32 masters in fp32"
        assert result["kept_dtypes"] == {torch.float32}, "master shards and optimizer state must stay fp32"
        assert result["wire"] == wire
        for fqn, ref in result["reference"].items() if param_rtol is not None else ():
            drift = ((result["params"][fqn] - ref).norm() / ref.norm()).item()
            assert drift < param_rtol, f"rank {rank}: {fqn} drifted {drift:.2e} from the bf16-compute reference"


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_bf16_compute_with_fp32_masters_matches_single_process_reference(pools, mode, reduce_dtype):
    # OddMLP's 0-d `scale` is replicated: its gradient is all-reduced, in the reduce dtype too.
    reduce = reduce_dtype or torch.bfloat16
    wire = {("all_gather", torch.bfloat16), ("reduce_scatter", reduce), ("all_reduce", reduce)}
    _check(pools(2).run(train_mixed_precision, "mlp", mode, reduce_dtype), wire)


def test_gpt_trains_in_bf16_like_the_single_process_reference(pools):
    # Adam turns near-zero gradients into full-size steps, so a few parameters drift by more than
    # the gradients differ: the parameters are checked to 5%, the gradients to bf16 accuracy.
    wire = {("all_gather", torch.bfloat16), ("reduce_scatter", torch.bfloat16)}
    _check(pools(2).run(train_mixed_precision, "gpt", "aot_eager", None), wire, param_rtol=5e-2)


def test_qwz_hpz_qgz_under_mixed_precision(pools):
    """Two nodes of two: the forward gathers int8 quantized from the fp32 masters, the backward
    gathers the int8 secondary inside the node, the bf16 gradients travel as int4 (packed in
    uint8), and nothing crosses the wire in a float dtype. One step: int4 gradient noise, which
    Adam turns into full-size steps, is measured on loss curves (benchmarks/qgz_convergence.py)."""
    results = pools(4).run(
        train_mixed_precision, "gpt", "aot_eager", None, 1,
        dict(quantize_weights=True, hpz_size=2, quantize_gradients=True, ranks_per_node=2),
    )  # fmt: skip
    _check(results, {("all_gather", torch.int8), ("all_to_all", torch.uint8)}, grad_rtol=0.1, param_rtol=None)


def autocast_vs_reference(name: str, mode: str) -> dict[str, float]:
    """torch.autocast around a sharded model (no param_dtype) against autocast around the unsharded one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build(name)
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, zpp_compile.Config(lowering="aot_eager"))
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    x, y = batch(name, LOCAL_BATCH * world, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank])
        ref_loss = loss_of(name, reference, x, y)
    loss.backward()
    ref_loss.backward()
    return gradient_errors(model, reference, 0)


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_autocast_around_a_sharded_model_matches_autocast_single_process(pools, mode):
    for rank, errors in enumerate(pools(2).run(autocast_vs_reference, "gpt", mode)):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= BF16_GRAD_RTOL, f"rank {rank}: {worst} off by {errors[worst]:.2e}"


def exported_dtypes() -> set:
    model = zpp_compile.shard(build("mlp"), zpp_compile.Config(param_dtype=torch.float16))
    return {t.dtype for t in zpp_compile.full_state_dict(model).values()}


def test_full_state_dict_exports_the_fp32_masters_not_their_fp16_copies(pools):
    assert pools(2).run(exported_dtypes) == [{torch.float32}] * 2


def fp16_reduce_dtypes() -> set:
    model = zpp_compile.shard(build("mlp"), zpp_compile.Config(param_dtype=torch.float16))
    return {shard_spec(p).reduce_dtype for p in model.parameters() if p.requires_grad}


def test_fp16_gradients_are_averaged_in_fp32_unless_asked_otherwise(pools):
    # An fp16 sum over many ranks overflows (65504) before the division by the world size.
    assert pools(2).run(fp16_reduce_dtypes) == [{torch.float32}] * 2


def test_hpz_full_precision_secondary_under_mixed_precision(pools):
    """hpZ without qwZ: the secondary shard is a slice of the bf16 weight the forward gathered, so
    the backward's in-node gather moves bf16 too, and gradients stay at bf16 accuracy."""
    config = dict(hpz_size=2, ranks_per_node=2)
    results = pools(4).run(train_mixed_precision, "gpt", "aot_eager", None, 2, config)
    _check(results, {("all_gather", torch.bfloat16), ("reduce_scatter", torch.bfloat16)}, param_rtol=5e-2)
