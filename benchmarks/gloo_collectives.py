"""The three forms of a large all-gather and reduce-scatter on gloo, in the same processes: gloo's
tensor collective (what compiled graphs' functional collectives call), the eager rooted form
(eager_collectives.py: synchronous, the peers' pieces through a scratch) and the compiled rooted
form (rooted_ops.py: asynchronous, issued then waited on). Time (median) and the memory each
holds beyond its input and output (torch.profiler's memory records, the largest over ranks).

    python benchmarks/gloo_collectives.py [--nproc 4] [--mb 147]

147 MB is GPT-2 small's tied embedding. Prints a markdown table (docs/architecture.md quotes it).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import benchmark_parser, run_workers, step_peak_bytes, worker_main  # noqa: E402

REPEATS = 5


def _forms(flat: torch.Tensor, shard: torch.Tensor) -> dict:
    """Each form as a function of a fresh input copy (the rooted reduce overwrites its input)."""
    from zpp_compile import eager_collectives

    c10d, zpp = torch.ops._c10d_functional, torch.ops.zpp
    group, world = dist.group.WORLD, dist.get_world_size()
    name = group.group_name

    def functional_reduce(x):
        c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", world, name))

    def eager_reduce(x):
        eager_collectives.reduce_scatter_flat(torch.empty_like(shard), x, group)

    def compiled_reduce(x):
        zpp.wait_rooted(zpp.rooted_reduce_scatter(x, shard.numel(), world, name))

    def functional_gather(x):
        c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, name))

    def eager_gather(x):
        eager_collectives.all_gather_flat(torch.empty_like(flat), x, group)

    def compiled_gather(x):
        zpp.wait_rooted(zpp.rooted_all_gather(x, world, name))

    return {
        ("reduce-scatter", "gloo's tensor collective (functional)"): (functional_reduce, flat),
        ("reduce-scatter", "rooted, eager (synchronous, scratch)"): (eager_reduce, flat),
        ("reduce-scatter", "rooted, compiled (asynchronous, in place)"): (compiled_reduce, flat),
        ("all-gather", "gloo's tensor collective (functional)"): (functional_gather, shard),
        ("all-gather", "rooted, eager (synchronous)"): (eager_gather, shard),
        ("all-gather", "rooted, compiled (asynchronous)"): (compiled_gather, shard),
    }


def measure(mb: int) -> list:
    from zpp_compile import eager_collectives

    world = dist.get_world_size()
    numel = mb * 2**20 // 4 // world * world
    flat, shard = torch.randn(numel), torch.randn(numel // world)
    assert eager_collectives.uses_rooted_form(flat, dist.group.WORLD), "below the rooted threshold"
    rows = []
    for (op, form), (run, source) in _forms(flat, shard).items():
        times = []
        for _ in range(REPEATS):
            x = source.clone()
            dist.barrier()
            start = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - start)
        x = source.clone()
        dist.barrier()
        # Beyond the output: the profiler counts the output's allocation, so take it off.
        output_bytes = (shard if op == "reduce-scatter" else flat).numel() * 4
        extra = torch.tensor([step_peak_bytes(lambda: run(x)) - output_bytes], dtype=torch.float64)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        rows.append((op, form, statistics.median(times) * 1e3, extra.item() / 2**20))
    return rows


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--mb", type=int, default=147)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.out, lambda: measure(args.mb))
    rows = run_workers(__file__, args.nproc, ["--mb", str(args.mb)])
    print(
        f"`python benchmarks/gloo_collectives.py --nproc {args.nproc} --mb {args.mb}` (world {args.nproc}, "
        f"CPU, gloo, fp32, median of {REPEATS}; extra memory: the most bytes held beyond the output, "
        "largest rank)\n"
    )
    print("| collective | form | ms | extra MB |\n| --- | --- | --- | --- |")
    for op, form, ms, extra in rows:
        print(f"| {op} | {form} | {ms:.0f} | {extra:.0f} |")


if __name__ == "__main__":
    main()
