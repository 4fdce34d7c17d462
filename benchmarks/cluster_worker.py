"""One rank of the two-node cluster benchmark (benchmarks/cluster.py launches it under torchrun).

Builds every config's model in this process (same seed, same data), warms each up (the first step
includes compilation: its time is the compile-time figure), then times the configs' steps
round-robin. Around each step: a barrier, then rank 0 reads the link's byte counters, so each
window holds one config's step only. The step time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zpp_compile  # noqa: E402
from benchmarks._common import tracked  # noqa: E402
from benchmarks.cluster import link_bytes  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

TRIAL_STEPS = 3  # Config.plan_trial_steps of the "timed" automatic plans
# Warm-up steps at most while a plan trial runs (3 candidates x (1 + TRIAL_STEPS) steps, per graph).
TRIAL_WARMUP_LIMIT = 40
QWZ_HPZ = {"quantize_weights": True, "hpz_size": 2}
ZERO_PP = {**QWZ_HPZ, "quantize_gradients": True}
CONFIGS: dict[str, tuple[str, dict]] = {
    "zeropp ZeRO-3": ("zeropp", {}),
    "zeropp + qwZ": ("zeropp", {"quantize_weights": True}),
    "zeropp + hpZ": ("zeropp", {"hpz_size": 2}),
    "zeropp + qgZ": ("zeropp", {"quantize_gradients": True}),
    "zeropp qwZ+hpZ": ("zeropp", QWZ_HPZ),
    "zeropp qwZ+hpZ+qgZ": ("zeropp", ZERO_PP),
    "zeropp + hier. reduce": ("zeropp", {"hierarchical_reduce": True}),
    "zeropp qwZ+hpZ+hier. reduce": ("zeropp", {**QWZ_HPZ, "hierarchical_reduce": True}),
    "zeropp qwZ+hpZ+hier.": ("zeropp", {**QWZ_HPZ, "hierarchical_reduce": True, "hierarchical_gather": True}),
    "zeropp qwZ+hpZ+qgZ+hier. gather": ("zeropp", {**ZERO_PP, "hierarchical_gather": True}),
    "zeropp auto": ("zeropp", {"plan": "auto"}),
    "zeropp auto lossy": ("zeropp", {"plan": "auto", "allow_lossy": True}),
    "zeropp auto timed": ("zeropp", {"plan": "auto", "plan_trial_steps": TRIAL_STEPS}),
    "zeropp auto lossy timed": ("zeropp", {"plan": "auto", "allow_lossy": True, "plan_trial_steps": TRIAL_STEPS}),
    "FSDP2 fp32": ("fsdp2", {}),
    "FSDP2 bf16": ("fsdp2", {"bf16": True}),
    "DDP fp32": ("ddp", {}),
    "DDP bf16 comm": ("ddp", {"bf16": True}),
    "DDP + Inductor": ("ddp", {"compile": True}),
}
# Gradient accumulation, K micro-batches of BATCH / K sequences per optimizer step (so the same
# tokens per step as above): every backward reduce-scatters (sync), or the first K-1 run under
# zpp_compile.no_sync and only the last reduces (benchmarks/cluster.py --grad-accum).
GRAD_ACCUM = 4
ACCUMULATION_CONFIGS: dict[str, tuple[str, dict]] = {
    f"zeropp K={GRAD_ACCUM} sync": ("zeropp", {"grad_accum": GRAD_ACCUM}),
    f"zeropp K={GRAD_ACCUM} no_sync": ("zeropp", {"grad_accum": GRAD_ACCUM, "no_sync": True}),
    f"zeropp qgZ K={GRAD_ACCUM} sync": ("zeropp", {"grad_accum": GRAD_ACCUM, "quantize_gradients": True}),
    f"zeropp qgZ K={GRAD_ACCUM} no_sync": (
        "zeropp",
        {"grad_accum": GRAD_ACCUM, "no_sync": True, "quantize_gradients": True},
    ),
}
# Hand-picked twins of what Config(plan="auto") chose on this cluster, with and without keeping the
# small parameters whole, to take its choices apart one at a time (docs/auto_plan.md); only by --configs.
KEEP_WHOLE_CONFIGS: dict[str, tuple[str, dict]] = {
    "zeropp qwZ+hpZ keep 256": ("zeropp", {**QWZ_HPZ, "keep_whole_numel": 256}),
    "zeropp qwZ+hpZ prefetch 4": ("zeropp", {**QWZ_HPZ, "prefetch_limit": 4}),
    "zeropp qwZ+hpZ prefetch 4 keep 1024": ("zeropp", {**QWZ_HPZ, "prefetch_limit": 4, "keep_whole_numel": 1024}),
    "zeropp qwZ+hpZ+hier. keep 256": (
        "zeropp",
        {**QWZ_HPZ, "hierarchical_reduce": True, "hierarchical_gather": True, "keep_whole_numel": 256},
    ),
}
ALL_CONFIGS = {**CONFIGS, **ACCUMULATION_CONFIGS, **KEEP_WHOLE_CONFIGS}
MODEL = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH = 4  # sequences per rank per step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(MODEL)


def _zeropp(options: dict) -> tuple[torch.nn.Module, Callable]:
    options = {k: v for k, v in options.items() if k not in ("grad_accum", "no_sync")}
    model = zpp_compile.shard(_model(), zpp_compile.Config(ranks_per_node=2, **options))
    return model, torch.compile(model, backend="zeropp")


def _kept_whole(threshold: int) -> str:
    return f"; parameters of <= {threshold} elements kept whole" if threshold else ""


def plan_of(model: torch.nn.Module) -> dict:
    """Config(plan="auto"): what each graph's plan chose, its estimated and measured bytes."""
    if not zpp_compile.is_sharded(model) or not model._zpp_state.auto_plans:
        return {}
    plans = model._zpp_state.auto_plans
    return {
        "plan": "; ".join(p.chosen.option.name for p in plans) + _kept_whole(plans[0].config.keep_whole_numel),
        "plan_estimated_bytes": max(p.persistent_bytes + p.chosen.memory_bytes for p in plans),
        "plan_measured_bytes": max(p.measured_bytes for p in plans),
        "budget_bytes": plans[0].budget_bytes,
        "estimated_step_s": sum(p.chosen.step_s for p in plans),
        "plan_explained": "\n".join(str(p) for p in plans),
    }


def _fsdp2(options: dict) -> tuple[torch.nn.Module, Callable]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    bf16 = torch.bfloat16 if options.get("bf16") else None
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, model


def _bf16_all_reduce_hook(_, bucket):
    """DDP's bucket all-reduce in bf16 (PyTorch's bf16_compress_hook refuses anything but NCCL)."""
    world = dist.get_world_size()
    compressed = bucket.buffer().to(torch.bfloat16).div_(world)

    def decompress(future):
        return bucket.buffer().copy_(future.value()[0])

    return dist.all_reduce(compressed, async_op=True).get_future().then(decompress)


def _ddp(options: dict) -> tuple[torch.nn.Module, Callable]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    if options.get("bf16"):
        model.register_comm_hook(None, _bf16_all_reduce_hook)
    return model, torch.compile(model) if options.get("compile") else model


BUILDERS = {"zeropp": _zeropp, "fsdp2": _fsdp2, "ddp": _ddp}
BUILT: dict[int, torch.nn.Module] = {}  # every model build_step made, in order


def build_step(kind: str, options: dict) -> Callable[[torch.Tensor], float]:
    model, run = BUILDERS[kind](options)
    BUILT[len(BUILT)] = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tokens: torch.Tensor) -> float:
        loss = run(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    k = options.get("grad_accum", 1)
    if k == 1:
        return step

    def accumulated_step(tokens: torch.Tensor) -> float:
        total = 0.0
        for i, micro in enumerate(tokens.chunk(k)):
            quiet = options.get("no_sync") and i < k - 1
            with zpp_compile.no_sync(model) if quiet else contextlib.nullcontext():
                loss = run(micro[:, :-1], micro[:, 1:])
                (loss / k).backward()
            total += loss.item() / k
        opt.step()
        opt.zero_grad()
        return total

    return accumulated_step


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sum(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def measure(step: Callable, tokens: torch.Tensor) -> dict:
    """One step: its time (slowest rank), the link's bytes (rank 0's counters) and the counter's."""
    counter = zpp_compile.comm_counter()
    dist.barrier()
    before = link_bytes() if dist.get_rank() == 0 else 0
    counter.reset()
    start = time.perf_counter()
    loss = step(tokens)
    seconds = time.perf_counter() - start
    dist.barrier()
    crossed = link_bytes() - before if dist.get_rank() == 0 else 0
    return {"s": _slowest(seconds), "link": crossed, "counted": _sum(counter.bytes(locality="inter")),
            "counted_intra": _sum(counter.bytes(locality="intra")), "loss": loss,
            "reduce_inter": _sum(_gradient_reduction_bytes(counter, "inter")),
            "reduce_intra": _sum(_gradient_reduction_bytes(counter, "intra"))}  # fmt: skip


def _finish_plan_trials(model: torch.nn.Module, step: Callable, tokens: torch.Tensor) -> None:
    """Step a "timed" automatic plan until its trial has kept a plan (Config.plan_trial_steps):
    its steps run back to back, as in training, and none of them is in the round-robin's timing."""
    for _ in range(TRIAL_WARMUP_LIMIT):
        if not any(p.awaiting_trial for p in zpp_compile.explain(model).auto_plans):
            return
        measure(step, tokens)
    raise RuntimeError(f"the plan trial did not finish within {TRIAL_WARMUP_LIMIT} steps")


def _gradient_reduction_bytes(counter: zpp_compile.CommCounter, locality: str) -> int:
    """Bytes this rank sent reducing gradients (reduce-scatter, qgZ's all-to-alls, all-reduce)."""
    ops = ("reduce_scatter", "all_to_all", "all_reduce")
    return sum(counter.bytes(phase="backward", op=op, locality=locality) for op in ops)


def start_rank() -> torch.Tensor:
    """Join the gloo group (torchrun's environment) and return this rank's batch, the same every step."""
    # Every zeropp config is a model of one class (its frame's compiles add up), and one under
    # no_sync compiles three variants (sync, accumulate, flush): keep them all compiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    dist.init_process_group("gloo")
    return torch.randint(
        0, MODEL.vocab_size, (BATCH, MODEL.block_size + 1), generator=torch.Generator().manual_seed(dist.get_rank())
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--configs", default=None, help=f"comma-separated, any of {', '.join(ALL_CONFIGS)}")
    p.add_argument("--grad-accum", action="store_true", help="default configs: ACCUMULATION_CONFIGS")
    args = p.parse_args()
    args.configs = args.configs or ",".join(ACCUMULATION_CONFIGS if args.grad_accum else CONFIGS)
    tokens = start_rank()
    names = args.configs.split(",")
    steps, first = {}, {}
    for name in tracked(names, "first steps (compile)"):
        steps[name] = build_step(*ALL_CONFIGS[name])
        first[name] = measure(steps[name], tokens)["s"]
        measure(steps[name], tokens)
        if ALL_CONFIGS[name][1].get("plan_trial_steps"):
            _finish_plan_trials(BUILT[len(BUILT) - 1], steps[name], tokens)
    samples = {name: [] for name in names}
    for _ in tracked(range(args.steps), "timed steps, every config"):
        for name in names:
            samples[name].append(measure(steps[name], tokens))
    if dist.get_rank() == 0:
        results = {
            name: {
                "first_step_s": first[name],
                "step_s": statistics.median(s["s"] for s in rows),
                "link_bytes": statistics.median(s["link"] for s in rows),
                "counted_inter_bytes": statistics.median(s["counted"] for s in rows),
                "counted_intra_bytes": statistics.median(s["counted_intra"] for s in rows),
                "reduce_inter_bytes": statistics.median(s["reduce_inter"] for s in rows),
                "reduce_intra_bytes": statistics.median(s["reduce_intra"] for s in rows),
                "loss": rows[-1]["loss"],
                **plan_of(BUILT[i]),
            }
            for i, (name, rows) in enumerate(samples.items())
        }
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
