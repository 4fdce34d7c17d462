"""Train a small byte-level GPT on the Python standard library's own source, sharded by zpp_compile.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # compiled, ZeRO-3
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --eager    # eager reference
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --ranks-per-node 2 --qwz --hpz 2 --qgz
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --bf16 --checkpoint-dir ckpt --save-every 50
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --bf16 --checkpoint-dir ckpt --resume

Every machine with Python has the data: the .py files of the standard library, read as bytes.
Writes the loss curve to runs/train_gpt_<mode>.csv.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout as well

import zpp_compile  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eager", action="store_true", help="run the sharded model without torch.compile")
    p.add_argument("--lowering", choices=["inductor", "aot_eager"], default="inductor")
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulate several nodes on one machine")
    p.add_argument("--qwz", action="store_true", help="ZeRO++ qwZ: int8 forward weight gathers")
    p.add_argument("--hpz", type=int, default=None, metavar="K", help="ZeRO++ hpZ: secondary partition of K ranks")
    p.add_argument("--qgz", action="store_true", help="ZeRO++ qgZ: int4 hierarchical gradient all-to-alls")
    p.add_argument("--qgz-ef", action="store_true", help="qgZ with error feedback")
    p.add_argument("--bf16", action="store_true", help="mixed precision: bf16 gathers and compute, fp32 masters")
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints to DIR/step_<N>")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--data-mb", type=float, default=8.0, help="megabytes of stdlib source to read")
    p.add_argument("--out-dir", default="runs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_stdlib_bytes(limit_mb: float) -> torch.Tensor:
    """The standard library's .py files, sorted by path, concatenated as bytes (identical on every rank)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_mb * 1e6:
            break
    return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()


def sample_starts(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, data.numel() - block - 1, (batch,), generator=gen)


def sample_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = sample_starts(data, batch, block, gen)
    window = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def init_distributed() -> None:
    if "RANK" not in os.environ:  # plain `python examples/train_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))


def main() -> None:
    args = parse_args()
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    data = load_stdlib_bytes(args.data_mb)
    split = int(0.95 * data.numel())
    train_data, val_data = data[:split], data[split:]

    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    config = zpp_compile.Config(
        ranks_per_node=args.ranks_per_node,
        lowering=args.lowering,
        quantize_weights=args.qwz,
        hpz_size=args.hpz,
        quantize_gradients=args.qgz or args.qgz_ef,
        qgz_error_feedback=args.qgz_ef,
        param_dtype=torch.bfloat16 if args.bf16 else None,
    )
    zpp_compile.shard(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    run = model if args.eager else torch.compile(model, backend="zeropp")
    flags = (
        ("bf16", args.bf16),
        ("qwz", args.qwz),
        (f"hpz{args.hpz}", args.hpz),
        ("qgz", args.qgz and not args.qgz_ef),
        ("qgz-ef", args.qgz_ef),
    )
    features = [name for name, on in flags if on]
    mode = "eager" if args.eager else "+".join([f"compiled-{args.lowering}", *features])

    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"zpp_compile {mode}: GPT {n_params / 1e6:.2f}M params, world {world}, "
        f"{train_data.numel() / 1e6:.1f}M training bytes of stdlib source")
    bar = _progress(args.steps, enabled=rank == 0)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    first = resume(model, opt, args, gen, train_data, log) + 1
    if first > args.steps:
        log(f"the checkpoint is at step {first - 1}: nothing left of --steps {args.steps}")
        return dist.destroy_process_group()
    rows, step_times, sent_bytes = [], [], 0
    counter = zpp_compile.comm_counter()
    for step in range(first, args.steps + 1):
        counter.reset()
        t0 = time.perf_counter()
        x, y = sample_batch(train_data, args.batch_size, args.block_size, gen)
        loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = _world_mean(loss.detach())
        dt = time.perf_counter() - t0
        step_times.append(dt)
        sent_bytes = counter.bytes()
        rows.append((step, mean_loss, dt))
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.3f}")
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            bar.write(f"step {step:5d}  loss {mean_loss:.4f}  {dt * 1e3:7.1f} ms/step  "
                      f"sent {sent_bytes / 1e6:.2f} MB/rank/step")
        if args.checkpoint_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            zpp_compile.save_checkpoint(Path(args.checkpoint_dir) / f"step_{step}", model, opt, extra={"step": step})
    bar.close()

    val_loss = evaluate(run, model, val_data, args)
    summary = {
        "mode": mode,
        "world_size": world,
        "params": n_params,
        "steps": args.steps,
        "first_step_s": step_times[0],
        "median_step_ms": statistics.median(step_times[min(10, len(step_times) - 1):]) * 1e3,
        "sent_mb_per_rank_step": sent_bytes / 1e6,
        "final_train_loss": rows[-1][1],
        "val_loss": val_loss,
    }
    log(f"first step (compile included) {summary['first_step_s']:.1f} s; median step "
        f"{summary['median_step_ms']:.1f} ms; final train loss {rows[-1][1]:.4f}; val loss {val_loss:.4f}")
    if rank == 0:
        write_csv(Path(args.out_dir) / f"train_gpt_{mode}.csv", rows)
        (Path(args.out_dir) / f"train_gpt_{mode}.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


def resume(model, opt, args: argparse.Namespace, gen: torch.Generator, data: torch.Tensor, log) -> int:
    """With --resume, load the newest complete DIR/step_<N> (at any world size) and return N, else 0.

    latest_checkpoint skips, with a warning, newer folders that a killed save left incomplete.
    The data stream continues where it stopped: this rank's generator replays N draws. (Ranks
    draw their own batches, so a run resumed at another world size sees other batches.)"""
    if not args.resume:
        return 0
    folder = zpp_compile.latest_checkpoint(args.checkpoint_dir or ".")
    if folder is None:
        log(f"--resume: no complete checkpoint in {args.checkpoint_dir}; starting from step 1")
        return 0
    step = int(zpp_compile.load_checkpoint(folder, model, opt)["step"])
    for _ in range(step):
        sample_starts(data, args.batch_size, args.block_size, gen)
    log(f"resumed from {folder} (step {step})")
    return step


@torch.no_grad()
def evaluate(run, model, val_data: torch.Tensor, args: argparse.Namespace, batches: int = 4) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(12345 + dist.get_rank())
    losses = [run(*sample_batch(val_data, args.batch_size, args.block_size, gen)) for _ in range(batches)]
    model.train()
    return _world_mean(torch.stack(losses).mean())


def _world_mean(value: torch.Tensor) -> float:
    value = value.clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def write_csv(path: Path, rows: list[tuple[int, float, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "step_seconds"])
        writer.writerows((s, f"{loss:.6f}", f"{dt:.4f}") for s, loss, dt in rows)
    print(f"wrote {path}")


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is an optional extra; fall back to plain lines
        tqdm = None
    if tqdm is not None:
        return tqdm(total=total, disable=not enabled, dynamic_ncols=True)
    return _PlainProgress(enabled)


class _PlainProgress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass

    def write(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
