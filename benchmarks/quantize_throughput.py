"""qwZ kernels: quantize / dequantize throughput against a plain copy, and the block-size trade-off.

    python benchmarks/quantize_throughput.py [--numel 16777216] [--device cpu|cuda]

Kernels timed, all in one run (compare ratios, not absolute figures: machines here are shared):
  * copy:        dst.copy_(src) of the fp32 tensor, the memory-bound yardstick;
  * clone:       the same copy into a freshly allocated tensor, as every kernel here writes one
                 (on CPU a fresh large buffer costs its page faults, which dominate dequantize);
  * inductor:    quantize.py compiled by torch.compile (C++/OpenMP on CPU, Inductor Triton on GPU);
  * eager:       quantize.py run op by op (what an uncompiled implementation costs);
  * triton:      the hand-written kernels (GPU only; the interpreter is far too slow to time).
GB/s counts the bytes a kernel must move: quantize reads the fp32 shard and writes the payload,
dequantize reads the payload and writes fp32. Then, per block size: the wire overhead of the
scales and the quantization error on normal, heavy-tailed and GPT-initialised weights.
Prints markdown and writes it to docs/qwz_kernels.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from zpp_compile.codegen import quantize
from zpp_compile.codegen.quantize import payload_numel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for examples.gpt
BLOCKS = (64, 128, 256, 512, 1024, 2048)


def median_seconds(fn: Callable[[], object], device: str, repeats: int = 9) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_sets(device: str) -> dict[str, tuple[Callable, Callable]]:
    sets = {
        "inductor": (torch.compile(quantize.quantize_packed), torch.compile(quantize.dequantize_packed)),
        "eager": (quantize.quantize_packed, quantize.dequantize_packed),
    }
    if device == "cuda":
        from zpp_compile.codegen import triton_quantize

        sets["triton"] = (triton_quantize.quantize_packed, triton_quantize.dequantize_packed)
    return sets


def throughput_rows(numel: int, block: int, device: str) -> list[str]:
    x = torch.randn(numel, device=device)
    dst = torch.empty_like(x)
    fp32_bytes, wire_bytes = numel * 4, payload_numel(numel, block)
    moved = fp32_bytes + wire_bytes
    copy_s = median_seconds(lambda: dst.copy_(x), device)
    clone_s = median_seconds(lambda: x.clone(), device)
    rows = [
        f"| copy (fp32 -> fp32, into a reused buffer) | {2 * fp32_bytes / copy_s / 1e9:.2f} | {copy_s * 1e3:.2f} ms | 1.00 |",
        f"| clone (fp32 -> fp32, fresh output) | {2 * fp32_bytes / clone_s / 1e9:.2f} | {clone_s * 1e3:.2f} ms "
        f"| {clone_s / copy_s:.2f} |",
    ]
    for name, (quant, dequant) in kernel_sets(device).items():
        payload = quant(x, block)
        q_s = median_seconds(lambda: quant(x, block), device)
        d_s = median_seconds(lambda: dequant(payload, 1, numel, block, torch.float32), device)
        for kind, s in (("quantize", q_s), ("dequantize", d_s)):
            rows.append(f"| {name} {kind} | {moved / s / 1e9:.2f} | {s * 1e3:.2f} ms | {s / copy_s:.2f} |")
    return rows


def weight_samples(numel: int) -> dict[str, torch.Tensor]:
    from examples.gpt import GPT, GPTConfig

    g = torch.Generator().manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=256))
    gpt_weights = torch.cat([p.detach().reshape(-1) for p in gpt.parameters() if p.dim() == 2])
    return {
        "normal": torch.randn(numel, generator=g),
        "student-t (3)": torch.distributions.StudentT(3.0).sample((numel,)),
        "GPT init": gpt_weights,
    }


def block_size_rows(numel: int, device: str) -> tuple[list[str], list[str]]:
    samples = weight_samples(numel)
    quant = torch.compile(quantize.quantize_packed)
    x = samples["normal"].to(device)
    rows = []
    for block in BLOCKS:
        quant_ms = median_seconds(lambda: quant(x, block), device) * 1e3
        errors = []
        for x in samples.values():
            back = quantize.dequantize_packed(quantize.quantize_packed(x, block), 1, x.numel(), block, torch.float32)
            errors.append(((back - x).norm() / x.norm()).item())
        overhead = 4 / block
        errors_text = " | ".join(f"{e:.2e}" for e in errors)
        rows.append(f"| {block} | {overhead:.2%} | {quant_ms:.2f} | {errors_text} |")
    return rows, list(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=16 * 2**20)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--block", type=int, default=256)
    args = p.parse_args()
    command = f"`python benchmarks/quantize_throughput.py --numel {args.numel} --device {args.device}`"
    lines = [
        f"## Throughput ({args.device}, {torch.get_num_threads()} threads, {args.numel} fp32 values, "
        f"block {args.block})",
        "",
        command,
        "",
        "| kernel | GB/s moved | median time | time / copy |",
        "| --- | --- | --- | --- |",
        *throughput_rows(args.numel, args.block, args.device),
        "",
    ]
    error_numel = min(args.numel, 2**22)
    error_rows, sample_names = block_size_rows(error_numel, args.device)
    lines += [
        "## Block size: wire overhead, quantize time and quantize-dequantize error (relative L2)",
        "",
        f"Inductor quantize of {error_numel} normal values; errors on {error_numel} values per sample.",
        "",
        "| block | scale bytes / int8 bytes | quantize ms | " + " | ".join(sample_names) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in sample_names) + " |",
        *error_rows,
    ]
    text = "\n".join(lines)
    print(text)
    out = ROOT / "docs" / f"qwz_kernels_{args.device}.md"
    out.write_text(f"# qwZ kernels: measured ({args.device})\n\n" + text + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
