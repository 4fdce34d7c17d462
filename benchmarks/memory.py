"""Peak memory per rank from process start through 3 training steps of Hugging Face GPT-2 small
(124M parameters): zpp_compile (meta-device init), FSDP2 (fully_shard per block, meta init +
to_empty + init) and DDP, each in fresh processes, plus the theoretical sharded state.

    python benchmarks/memory.py [--nproc 4] [--steps 3] [--configs zeropp,zeropp_compiled,zeropp_full,fsdp2,ddp]
                                [--batch 2]

zeropp_full is qwZ + hpZ + qgZ on 2 simulated nodes (compiled); zeropp_dynamic, named in --configs
only, is zeropp_compiled with dynamic shapes (torch.compile(dynamic=True)), zeropp_compiled_whole
(likewise named) zeropp_compiled lowered whole, not region by region (Config.inductor_regions=False),
as graphs with symbolic shapes are. Peak RSS is the kernel's
high-water mark of each process (ru_maxrss); the table reports the largest rank's. Each config runs
twice: with glibc malloc's defaults, and with its mmap threshold fixed at 128 KiB. By default
glibc raises that threshold to the size of each large block freed (up to 32 MiB), after which
blocks of that size come from the heap and stay in RSS once freed: the figure then counts memory
the allocator keeps, not memory the program holds. Fixed, every large tensor is a mapping of its
own, returned to the OS when freed. Writes the table to docs/memory.md; with another --batch
than the default (sequences of 128 tokens per rank and step), it only prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import benchmark_parser, publish, run_workers, tracked  # noqa: E402

CONFIGS = ("zeropp", "zeropp_compiled", "zeropp_full", "fsdp2", "ddp")
EXTRA_CONFIGS = ("zeropp_dynamic", "zeropp_compiled_whole")  # run only when named in --configs
# glibc's defaults, then its mmap threshold fixed (freed tensors leave RSS): see the docstring.
ALLOCATORS = ({}, {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
SEQ, BATCH, VOCAB = 128, 2, 50257


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=1024)


def _build_zeropp(name: str, ranks_per_node: int):
    from transformers import GPT2LMHeadModel

    import zpp_compile

    with torch.device("meta"):
        model = GPT2LMHeadModel(_gpt2_config())
    full = name == "zeropp_full"
    config = zpp_compile.Config(
        ranks_per_node=ranks_per_node if full else None, quantize_weights=full, hpz_size=2 if full else None,
        quantize_gradients=full, inductor_regions=False if name == "zeropp_compiled_whole" else None,
    )  # fmt: skip
    zpp_compile.shard(model, config)
    zpp_compile.materialize(model, init=lambda m: m.init_weights())
    run = model if name == "zeropp" else torch.compile(model, backend="zeropp", dynamic=name == "zeropp_dynamic")
    return model, run


def _build_fsdp2():
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_gpt2_config())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights()
    return model, model


def _build_ddp():
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config())
    return model, torch.nn.parallel.DistributedDataParallel(model)


def measure(name: str, steps: int, ranks_per_node: int, batch: int = BATCH) -> dict:
    start = time.perf_counter()
    torch.manual_seed(0)
    if name.startswith("zeropp"):
        model, run = _build_zeropp(name, ranks_per_node)
    else:
        model, run = _build_fsdp2() if name == "fsdp2" else _build_ddp()
    after_init = _rss_mb()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in tracked(range(steps), f"{name}: steps"):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"after_init_mb": after_init, "peak_mb": _rss_mb(), "seconds": time.perf_counter() - start}


def theoretical_state_mb(world: int) -> float:
    """Sharded parameters, gradients and the two AdamW moments, fp32: 16 bytes per parameter / world."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT2LMHeadModel(_gpt2_config()).parameters())
    return params * 16 / world / 2**20


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=BATCH, help="sequences of 128 tokens per rank and step")
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
        result = measure(args.config, args.steps, args.ranks_per_node, args.batch)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(everyone))
        dist.destroy_process_group()
        return
    unknown = set(args.configs.split(",")) - {*CONFIGS, *EXTRA_CONFIGS}
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {', '.join((*CONFIGS, *EXTRA_CONFIGS))}")
    rows = []
    for name in tracked(args.configs.split(","), "configs"):
        row = [name]
        for env in ALLOCATORS:
            # A cold start, as a new user's first run: Inductor's cache (and zpp_compile's in it)
            # starts empty, so the figures do not depend on what ran before.
            with tempfile.TemporaryDirectory() as cache:
                worker_args = ["--config", name, "--steps", str(args.steps), "--batch", str(args.batch)]
                per_rank = run_workers(__file__, args.nproc, worker_args, {**env, "TORCHINDUCTOR_CACHE_DIR": cache})
            row += [max(r["after_init_mb"] for r in per_rank), max(r["peak_mb"] for r in per_rank)]
        rows.append(tuple(row))
        print(f"{name}: {rows[-1]}", flush=True)
    table = _table(rows, args, theoretical_state_mb(args.nproc))
    if args.batch == BATCH:
        publish(table, "memory.md", "Memory per rank: GPT-2 small")
    else:  # docs/memory.md keeps the default batch's table
        print(table)


def _table(rows: list, args, state_mb: float) -> str:
    """rows: (config, init MB, peak MB) with glibc's defaults, then (init MB, peak MB) with its mmap
    threshold fixed."""
    ddp = next((row for row in rows if row[0] == "ddp"), None)
    lines = [
        f"`python benchmarks/memory.py --nproc {args.nproc} --steps {args.steps}"
        + (f" --batch {args.batch}" if args.batch != BATCH else "")
        + f"` (HF GPT-2 small, 124M parameters, {args.batch} x {SEQ} tokens per rank per step, AdamW, CPU, gloo; peak RSS of the largest rank "
        "from process start, each run with an empty Inductor cache). Left: glibc malloc's defaults. Right: its mmap threshold fixed at 128 KiB "
        "(`MALLOC_MMAP_THRESHOLD_=131072`), so freed tensors leave RSS and the peak counts what the program "
        "holds rather than what the allocator keeps.",
        "",
        "| config | RSS after init MB | peak RSS MB | peak / DDP's | RSS after init MB, threshold fixed "
        "| peak RSS MB, threshold fixed | peak / DDP's, threshold fixed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, init_mb, peak, fixed_init_mb, fixed_peak in rows:
        ratio = f"{peak / ddp[2]:.2f}" if ddp else "-"
        fixed_ratio = f"{fixed_peak / ddp[4]:.2f}" if ddp else "-"
        lines.append(
            f"| {name} | {init_mb:.0f} | {peak:.0f} | {ratio} | {fixed_init_mb:.0f} | {fixed_peak:.0f} | {fixed_ratio} |"
        )
    lines += [
        "",
        f"Theoretical sharded state (fp32 parameters, gradients, AdamW moments / {args.nproc}): {state_mb:.0f} MB.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
