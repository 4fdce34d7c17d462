"""Train a small byte-level language model on the Python standard library's own source, sharded by
zpp_compile: a plain torchrun script with the training loop of nanoGPT / torchtitan.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # compiled, ZeRO-3
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --eager    # eager reference
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --ranks-per-node 2 --qwz --hpz 2 --qgz
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --clip 1.0 --warmup 20 --min-lr 1e-4
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --grad-accum 4 --batch-size 2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --model hf-llama   # or hf-gpt2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --bf16 --checkpoint-dir ckpt --save-every 50
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --bf16 --checkpoint-dir ckpt --resume
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --device cuda --bf16   # one GPU per rank, nccl

Every machine with Python has the data: the .py files of the standard library, read as bytes.
Rank 0 logs, every --log-every steps: the loss (world mean), the learning rate (linear warmup,
then cosine decay to --min-lr), the global gradient norm before clipping, ms/step, tokens/s over
all ranks, peak memory (CPU: the process's peak RSS; CUDA: max_memory_allocated) and the bytes this
rank sent in the step, inside its node and to other nodes. At the end it writes to --out-dir:
train_gpt_<mode>.csv (one row per step), train_gpt_<mode>.json (summary) and, when matplotlib is
installed, train_gpt_<mode>.png (the loss curve).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout as well

import zpp_compile  # noqa: E402
from examples.training_utils import (  # noqa: E402,F401  (sample_batch etc.: the benchmarks import them from here)
    MODELS,
    FirstStepNotice,
    LossFn,
    StepRecord,
    build_model,
    compile_times_logged,
    forward_backward,
    history_tensor,
    load_stdlib_bytes,
    lr_at,
    peak_memory_bytes,
    plot_loss_curve,
    progress,
    records_from_history,
    sample_batch,
    sample_starts,
    write_csv,
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--model", choices=MODELS, default="gpt",
                       help="gpt: examples/gpt.py; hf-gpt2 / hf-llama: a Hugging Face model of the same size, "
                            "built from a config (nothing downloaded)")  # fmt: skip
    model.add_argument("--block-size", type=int, default=128)
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--dropout", type=float, default=0.0,
                       help="hf-gpt2 / hf-llama: dropout probability (GPT-2's default is 0.1)")  # fmt: skip
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=200, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    train.add_argument("--grad-accum", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    train.add_argument("--reduce-every-micro-batch", action="store_true",
                       help="with --grad-accum: reduce gradients after every micro-batch instead of once per "
                            "step (no zpp_compile.no_sync; less memory, K times the gradient bytes)")  # fmt: skip
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    train.add_argument("--min-lr", type=float, default=None, help="learning rate at the last step (default: --lr / 10)")
    train.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warmup")
    train.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                       help="after the warmup: cosine decay to --min-lr, or constant --lr")  # fmt: skip
    train.add_argument("--clip", type=float, default=None, metavar="MAX", help="clip gradients to global norm MAX")
    train.add_argument("--data-mb", type=float, default=8.0, help="megabytes of stdlib source to read")
    train.add_argument("--val-batches", type=int, default=4, help="held-out batches per rank for the validation loss")
    train.add_argument("--seed", type=int, default=0)
    zpp = p.add_argument_group("zpp_compile")
    zpp.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="cpu (gloo) or cuda (nccl, one GPU per rank: LOCAL_RANK)")  # fmt: skip
    zpp.add_argument("--eager", action="store_true", help="run the sharded model without torch.compile")
    zpp.add_argument("--lowering", choices=["inductor", "aot_eager"], default="inductor")
    zpp.add_argument("--ranks-per-node", type=int, default=None, help="simulate several nodes on one machine")
    zpp.add_argument("--qwz", action="store_true", help="ZeRO++ qwZ: int8 forward weight gathers")
    zpp.add_argument("--hpz", type=int, default=None, metavar="K", help="ZeRO++ hpZ: secondary partition of K ranks")
    zpp.add_argument("--qgz", action="store_true", help="ZeRO++ qgZ: int4 hierarchical gradient all-to-alls")
    zpp.add_argument("--qgz-ef", action="store_true", help="qgZ with error feedback")
    zpp.add_argument("--qgz-error-beta", type=float, default=None, metavar="BETA",
                     help="with --qgz-ef: the share of the stored error kept each step (Config.qgz_error_beta)")  # fmt: skip
    zpp.add_argument(
        "--hierarchical-reduce",
        action="store_true",
        help="lossless gradient reduce: all-to-all in the node, then of the node sums across nodes",
    )
    zpp.add_argument(
        "--hierarchical-gather",
        action="store_true",
        help="weight all-gathers across nodes first (each part once per node), then in the node",
    )
    zpp.add_argument("--bf16", action="store_true", help="mixed precision: bf16 gathers and compute, fp32 masters")
    zpp.add_argument("--keep-whole", type=int, default=0, metavar="N",
                     help="Config.keep_whole_numel: parameters of at most N elements stay whole on every rank")  # fmt: skip
    zpp.add_argument(
        "--auto-plan",
        action="store_true",
        help="Config(plan='auto'): zpp_compile chooses qwZ/hpZ/buckets/prefetch (not with --qwz/--hpz/--qgz)",
    )
    zpp.add_argument("--allow-lossy", action="store_true", help="with --auto-plan: the plan may choose qgZ too")
    zpp.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB",
                     help="with --auto-plan: Config.memory_budget_bytes, in MB (10^6 bytes) per rank")  # fmt: skip
    zpp.add_argument("--plan-trial-steps", type=int, default=0, metavar="N",
                     help="with --auto-plan: time up to 3 tied candidate plans for N steps each, keep the fastest "
                          "(Config.plan_trial_steps); the plan is printed again once kept")  # fmt: skip
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints to DIR/step_<N>")
    io.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    io.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    io.add_argument("--log-every", type=int, default=20)
    io.add_argument("--notice-every", type=float, default=10.0, metavar="S",
                    help="while the first step (compilation) runs, say every S seconds how long it has taken")  # fmt: skip
    io.add_argument("--quiet-compile", action="store_true",
                    help="do not print each graph's compile time per stage (logger zpp_compile.compile_time)")  # fmt: skip
    io.add_argument("--out-dir", default="runs")
    args = p.parse_args(argv)
    if args.device == "cuda":
        _check_cuda(p)
    if args.grad_accum < 1:
        p.error("--grad-accum must be at least 1")
    if args.val_batches < 1:
        p.error("--val-batches must be at least 1")
    if args.qgz_error_beta is not None and not args.qgz_ef:
        p.error("--qgz-error-beta is a setting of error feedback: add --qgz-ef")
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    return args


def _check_cuda(p: argparse.ArgumentParser) -> None:
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        p.error(f"--device cuda: CUDA is not available (torch {torch.__version__}, {built}; "
                f"{torch.cuda.device_count()} GPUs visible). Leave out --device, or use --device cpu (gloo).")  # fmt: skip
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        p.error(f"--device cuda: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs visible; "
                "start at most one process per GPU (--nproc-per-node)")  # fmt: skip


def init_distributed(device_type: str) -> torch.device:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA with this rank's GPU = LOCAL_RANK)."""
    if "RANK" not in os.environ:  # plain `python examples/train_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")  # fmt: skip
    timeout = datetime.timedelta(seconds=300)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def zpp_config(args: argparse.Namespace) -> zpp_compile.Config:
    return zpp_compile.Config(
        ranks_per_node=args.ranks_per_node,
        lowering=args.lowering,
        quantize_weights=args.qwz,
        hpz_size=args.hpz,
        quantize_gradients=args.qgz or args.qgz_ef,
        hierarchical_reduce=args.hierarchical_reduce,
        hierarchical_gather=args.hierarchical_gather,
        qgz_error_feedback=args.qgz_ef,
        **({} if args.qgz_error_beta is None else {"qgz_error_beta": args.qgz_error_beta}),
        param_dtype=torch.bfloat16 if args.bf16 else None,
        plan="auto" if args.auto_plan else "manual",
        allow_lossy=args.allow_lossy,
        memory_budget_bytes=None if args.memory_budget_mb is None else int(args.memory_budget_mb * 1e6),
        plan_trial_steps=args.plan_trial_steps,
        keep_whole_numel=args.keep_whole,
    )


def trial_just_ended(model: torch.nn.Module) -> bool:
    """Whether the last step ended a plan trial (Config.plan_trial_steps): some graph's plan has
    timings, and none has candidates still to time. True once."""
    if getattr(model, "_trial_reported", False):
        return False
    plans = zpp_compile.explain(model).auto_plans
    model._trial_reported = any(p.trial_seconds for p in plans) and not any(p.awaiting_trial for p in plans)
    return model._trial_reported


def mode_name(args: argparse.Namespace) -> str:
    """Names the output files: eager, compiled-inductor, compiled-inductor+qwz+hpz2+qgz, ...;
    prefixed with the model for the Hugging Face ones."""
    flags = (
        ("bf16", args.bf16),
        ("qwz", args.qwz),
        (f"hpz{args.hpz}", args.hpz),
        ("qgz", args.qgz and not args.qgz_ef),
        ("qgz-ef", args.qgz_ef),
        ("hier", args.hierarchical_reduce),
        ("hierg", args.hierarchical_gather),
        (f"beta{args.qgz_error_beta:g}" if args.qgz_error_beta is not None else "", args.qgz_error_beta is not None),
        ("auto" + ("-lossy" if args.allow_lossy else ""), args.auto_plan),
        (f"whole{args.keep_whole}", args.keep_whole),
    )
    features = [name for name, on in flags if on]
    mode = "eager" if args.eager else "+".join([f"compiled-{args.lowering}", *features])
    return mode if args.model == "gpt" else f"{args.model}-{mode}"


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # every rank alike: the same initial weights
    data = load_stdlib_bytes(args.data_mb)
    split = int(0.95 * data.numel())
    train_data, val_data = data[:split], data[split:]

    model, loss_fn = build_model(args.model, block_size=args.block_size, n_layer=args.n_layer,
                                 n_embd=args.n_embd, n_head=args.n_head, dropout=args.dropout)  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    zpp_compile.shard(model.to(device), zpp_config(args))  # ZeRO-3: parameters partitioned across ranks
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    run = model if args.eager else torch.compile(model, backend="zeropp")
    mode = mode_name(args)
    tokens_per_step = world * args.grad_accum * args.batch_size * args.block_size

    log: Callable[[str], None] = print if rank == 0 else (lambda line: None)
    log(f"zpp_compile {mode}: {args.model} {n_params / 1e6:.2f}M params, world {world} on {device.type}, "
        f"{train_data.numel() / 1e6:.1f}M training bytes of stdlib source, {tokens_per_step} tokens/step "
        f"({args.grad_accum} x {args.batch_size} x {args.block_size} per rank)")  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    last_saved, records = resume(model, opt, args, gen, train_data, log)
    if last_saved >= args.steps:
        log(f"the checkpoint is at step {last_saved}: nothing left of --steps {args.steps}")
        return dist.destroy_process_group()

    bar = progress(args.steps, enabled=rank == 0, desc=mode)
    bar.update(last_saved)
    write = bar.write if rank == 0 else (lambda line: None)
    counter = zpp_compile.comm_counter()
    # --grad-accum K: the first K-1 micro-batches accumulate unsharded gradients without a reduce;
    # the last reduces them all at once (1/K of the gradient bytes on the wire).
    no_sync = contextlib.nullcontext if args.reduce_every_micro_batch else (lambda: zpp_compile.no_sync(model))
    step_times: list[float] = []
    first_step_s = 0.0
    for step in range(last_saved + 1, args.steps + 1):
        lr = set_lr(opt, step, args)
        counter.reset()
        t0 = time.perf_counter()
        micro_batches = [to_device(sample_batch(train_data, args.batch_size, args.block_size, gen), device)
                         for _ in range(args.grad_accum)]  # fmt: skip
        if step == last_saved + 1:
            label = "first step (eager)" if args.eager else "compiling (first step)"
            with (
                FirstStepNotice(label, enabled=rank == 0, every=args.notice_every, write=write) as notice,
                compile_times_logged(write, enabled=rank == 0 and not args.quiet_compile),
            ):
                loss = forward_backward(run, loss_fn, micro_batches, no_sync)
            first_step_s = notice.seconds
            if args.auto_plan and rank == 0:
                write(str(zpp_compile.explain(model)))  # the plan each graph got, and the options weighed
        else:
            loss = forward_backward(run, loss_fn, micro_batches, no_sync)
            if args.plan_trial_steps and rank == 0 and trial_just_ended(model):
                write(str(zpp_compile.explain(model)))  # with each candidate's measured step
        grad_norm = clip_or_measure(model, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = _world_mean(loss)  # also waits for the step (an all-reduce and .item())
        dt = time.perf_counter() - t0
        step_times.append(dt)
        record = StepRecord(
            step, mean_loss, lr, grad_norm, seconds=dt, tokens_per_s=tokens_per_step / dt,
            peak_mem_bytes=peak_memory_bytes(device), sent_intra=counter.bytes(locality="intra"),
            sent_inter=counter.bytes(locality="inter"),
        )  # fmt: skip
        records.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.3f}")
        if step % args.log_every == 0 or step == last_saved + 1 or step == args.steps:
            write(record.log_line(args.steps))
        if args.checkpoint_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            extra = {"step": step, "history": history_tensor(records)}
            zpp_compile.save_checkpoint(Path(args.checkpoint_dir) / f"step_{step}", model, opt, extra=extra)
    bar.close()

    val_loss = evaluate(run, model, loss_fn, val_data, args, device, args.val_batches)
    summary = summarize(args, mode, world, n_params, device, records, step_times, first_step_s, val_loss)
    log(f"first step ({'eager' if args.eager else 'compile included'}) {first_step_s:.1f} s; median step "
        f"{summary['median_step_ms']:.1f} ms; final train loss {summary['final_train_loss']:.4f}; "
        f"val loss {val_loss:.4f}")  # fmt: skip
    if rank == 0:
        write_outputs(Path(args.out_dir), mode, records, summary, val_loss)
    # Every rank done before any tears its group down. A mitigation, cause not confirmed: under
    # load a rank now and then aborted at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def set_lr(opt: torch.optim.Optimizer, step: int, args: argparse.Namespace) -> float:
    min_lr = args.lr if args.schedule == "constant" else args.min_lr
    lr = lr_at(step, base_lr=args.lr, min_lr=min_lr, warmup=args.warmup, total=args.steps)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def clip_or_measure(model: nn.Module, max_norm: Optional[float]) -> float:
    """The global gradient norm before clipping (all ranks' shards together); with max_norm, clip to it.

    torch.nn.utils.clip_grad_norm_ works unchanged on the sharded parameters: it clips by the global
    norm and returns it as a DTensor (as for FSDP2). Collective: every rank calls this every step."""
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    else:
        norm = zpp_compile.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return norm.item()


def to_device(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)


def resume(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    gen: torch.Generator,
    data: torch.Tensor,
    log: Callable[[str], None],
) -> tuple[int, list[StepRecord]]:
    """With --resume, load the newest complete DIR/step_<N> (at any world size) and return N and
    the loss curve up to it (kept in the checkpoint), else (0, []).

    latest_checkpoint skips, with a warning, newer folders that a killed save left incomplete.
    The data stream continues where it stopped: this rank's generator replays N steps' draws. (Ranks
    draw their own batches, so a run resumed at another world size sees other batches.)"""
    if not args.resume:
        return 0, []
    folder = zpp_compile.latest_checkpoint(args.checkpoint_dir or ".")
    if folder is None:
        log(f"--resume: no complete checkpoint in {args.checkpoint_dir}; starting from step 1")
        return 0, []
    extra = zpp_compile.load_checkpoint(folder, model, opt)
    step = int(extra["step"])
    for _ in range(step * args.grad_accum):
        sample_starts(data, args.batch_size, args.block_size, gen)
    records = records_from_history(extra.get("history"), step)
    last = f", loss {records[-1].loss:.4f}" if records else ""
    log(f"resumed from {folder} (step {step}{last})")
    return step, records


@torch.no_grad()
def evaluate(
    run: Callable[..., Any],
    model: nn.Module,
    loss_fn: LossFn,
    val_data: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    batches: int = 4,
) -> float:
    """Mean loss on `batches` held-out batches per rank (world mean)."""
    model.eval()
    gen = torch.Generator().manual_seed(12345 + dist.get_rank())
    losses = [loss_fn(run, *to_device(sample_batch(val_data, args.batch_size, args.block_size, gen), device))
              for _ in range(batches)]  # fmt: skip
    model.train()
    return _world_mean(torch.stack(losses).float().mean())


def _world_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def summarize(
    args: argparse.Namespace,
    mode: str,
    world: int,
    n_params: int,
    device: torch.device,
    records: list[StepRecord],
    step_times: list[float],
    first_step_s: float,
    val_loss: float,
) -> dict[str, Any]:
    """The run's JSON summary (benchmarks/step_time.py and qgz_convergence.py read it)."""
    steady = step_times[min(10, len(step_times) - 1) :]
    last = records[-1]
    median_s = statistics.median(steady)
    return {
        "mode": mode,
        "world_size": world,
        "params": n_params,
        "steps": args.steps,
        "first_step_s": first_step_s,
        "median_step_ms": median_s * 1e3,
        "sent_mb_per_rank_step": (last.sent_intra + last.sent_inter) / 1e6,
        "final_train_loss": last.loss,
        "val_loss": val_loss,
        "model": args.model,
        "device": device.type,
        "first_step": records[-len(step_times)].step,
        "grad_accum": args.grad_accum,
        "tokens_per_step": world * args.grad_accum * args.batch_size * args.block_size,
        "median_tokens_per_s": world * args.grad_accum * args.batch_size * args.block_size / median_s,
        "sent_intra_mb_per_rank_step": last.sent_intra / 1e6,
        "sent_inter_mb_per_rank_step": last.sent_inter / 1e6,
        "peak_memory_mb": last.peak_mem_bytes / 1e6,
        "final_grad_norm": last.grad_norm,
        "final_lr": last.lr,
        "clip": args.clip,
    }


def write_outputs(out: Path, mode: str, records: list[StepRecord], summary: dict[str, Any], val_loss: float) -> None:
    """CSV, JSON and the loss-curve PNG (rank 0), then the summary as a table."""
    csv_path, json_path, png_path = (out / f"train_gpt_{mode}{ext}" for ext in (".csv", ".json", ".png"))
    write_csv(csv_path, records)
    json_path.write_text(json.dumps(summary, indent=1))
    skipped = plot_loss_curve(records, png_path, f"examples/train_gpt.py {mode}, world {summary['world_size']}",
                              val=(records[-1].step, val_loss))  # fmt: skip
    print(f"wrote {csv_path}, {json_path}" + (f", {png_path}" if skipped is None else ""))
    if skipped is not None:
        print(f"loss-curve plot skipped: {skipped}")
    rows = [
        ("model", f"{summary['model']}, {summary['params'] / 1e6:.2f}M params"),
        ("mode", f"{mode}, world {summary['world_size']} on {summary['device']}"),
        ("steps", f"{summary['first_step']}..{summary['steps']}, {summary['tokens_per_step']} tokens/step"),
        ("first step (compile) s", f"{summary['first_step_s']:.1f}"),
        ("median step ms", f"{summary['median_step_ms']:.1f}"),
        ("median tokens/s", f"{summary['median_tokens_per_s']:.0f}"),
        ("sent MB/rank/step (intra, inter)",
         f"{summary['sent_intra_mb_per_rank_step']:.2f}, {summary['sent_inter_mb_per_rank_step']:.2f}"),
        ("peak memory MB (rank 0)", f"{summary['peak_memory_mb']:.0f}"),
        ("final train loss, val loss", f"{summary['final_train_loss']:.4f}, {val_loss:.4f}"),
    ]  # fmt: skip
    print("\n| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))


if __name__ == "__main__":
    main()
