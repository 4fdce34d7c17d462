"""What representing parameters as DTensors costs outside the compiled graphs: the optimizer step
and gradient clipping, against the same work on plain tensors of the local shapes (what the
parameters were before DTensors), in the same processes.

    python benchmarks/dtensor_overhead.py [--nproc 4] [--model gpt2-small|tiny]

Prints a markdown table (docs/architecture.md quotes it).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import benchmark_parser, run_workers, worker_main  # noqa: E402

REPEATS = 20


def _model(name: str) -> nn.Module:
    from examples.gpt import GPT, GPTConfig

    if name == "tiny":
        return GPT(GPTConfig())  # the example's 0.84M-parameter GPT
    return GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))  # GPT-2 small shape


def _median_ms(work) -> float:
    work()  # warm-up (optimizer state created)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def measure(name: str) -> dict:
    import zpp_compile

    torch.manual_seed(0)
    model = zpp_compile.shard(_model(name), zpp_compile.Config(prefetch_limit=0))
    dtensors = _with_grads([p for p in model.parameters()])
    plain = _with_grads([nn.Parameter(p.to_local().detach().clone()) for p in dtensors])
    rows = {}
    for foreach in (False, True):
        for label, params in (("DTensor", dtensors), ("plain", plain)):
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
            rows[f"AdamW step, foreach={foreach}, {label}"] = _median_ms(opt.step)
    rows["clip_grad_norm_, DTensor (global norm)"] = _median_ms(
        lambda: torch.nn.utils.clip_grad_norm_(dtensors, 1e9).item()
    )
    rows["clip_grad_norm_, plain (this rank's norm only)"] = _median_ms(
        lambda: torch.nn.utils.clip_grad_norm_(plain, 1e9).item()
    )
    rows["parameters"] = len(dtensors)
    return rows


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--model", choices=["gpt2-small", "tiny"], default="gpt2-small")
    args = p.parse_args()
    if args.worker:
        return worker_main(args.out, lambda: measure(args.model))
    rows = run_workers(__file__, args.nproc, ["--model", args.model])
    print(
        f"`python benchmarks/dtensor_overhead.py --nproc {args.nproc} --model {args.model}` "
        f"({rows.pop('parameters')} parameters, world {args.nproc}, CPU, median of {REPEATS})\n"
    )
    print("| work | ms |\n| --- | --- |")
    for label, ms in rows.items():
        print(f"| {label} | {ms:.2f} |")


if __name__ == "__main__":
    main()
