"""qgZ's int4 block size: wire overhead of the scales, quantization error and quantize time.

    python benchmarks/int4_block_size.py [--numel 4194304]

Errors are the relative L2 error of one int4 quantize-dequantize round trip on: normal values,
log-normal-scaled (heavy-tailed) values, and real gradients of the GPT example (one backward
pass of examples/gpt.py on random tokens). Writes docs/qgz_block_size.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for examples.gpt

from zpp_compile.codegen.int4 import dequantize_int4_chunks, quantize_int4_chunks  # noqa: E402

BLOCKS = (32, 64, 128, 256, 512, 1024)


def gpt_gradients() -> torch.Tensor:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    tokens = torch.randint(0, 256, (8, 65))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def samples(numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "normal": torch.randn(numel, generator=g),
        "heavy-tailed": torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g)),
        "GPT gradients": gpt_gradients(),
    }


def round_trip_error(x: torch.Tensor, block: int) -> float:
    chunk = -(-x.numel() // block) * block
    padded = torch.nn.functional.pad(x, (0, chunk - x.numel()))
    back = dequantize_int4_chunks(quantize_int4_chunks(padded, block), chunk, block)[: x.numel()]
    return ((back - x).norm() / x.norm()).item()


def quantize_ms(x: torch.Tensor, block: int) -> float:
    fn = torch.compile(quantize_int4_chunks)
    fn(x, block)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn(x, block)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=4 * 2**20)
    args = p.parse_args()
    data = samples(args.numel)
    x = data["normal"]
    lines = [
        f"`python benchmarks/int4_block_size.py --numel {args.numel}` ({torch.get_num_threads()} threads; "
        f"GPT gradients: {data['GPT gradients'].numel()} values)",
        "",
        "| block | scale bytes / int4 bytes | Inductor quantize ms | " + " | ".join(data) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in data) + " |",
    ]
    for block in BLOCKS:
        errors = " | ".join(f"{round_trip_error(v, block):.3f}" for v in data.values())
        lines.append(f"| {block} | {8 / block:.2%} | {quantize_ms(x, block):.2f} | {errors} |")
    text = "\n".join(lines)
    print(text)
    (ROOT / "docs" / "qgz_block_size.md").write_text("# qgZ int4 block size\n\n" + text + "\n")


if __name__ == "__main__":
    main()
