"""hpZ: memory and bytes of one training step per rank, against the M/W + M/hpz theory.

    python benchmarks/hpz_memory.py [--nproc 4] [--ranks-per-node 2] [--hpz 2]

Simulates nodes of `ranks-per-node` ranks on this machine (gloo) and trains the GPT example
compiled with the zeropp backend, in several configs, one after the other in the same processes.
Per config and rank 0 it reports:
  * saved for backward: bytes the forward graph hands to the backward graph (from the partitioned
    graphs), and the part of it that is weights (primary shards, or hpZ secondary shards);
  * step peak: the highest live bytes allocated during one step over what was live before it,
    from torch.profiler's memory records (so: on top of the persistent shards, grads and Adam);
  * bytes this rank sent per step, inter-node and intra-node, from the communication counter.
The scheduling passes are off here (one collective per parameter, issued where used), so the
figures isolate hpZ; benchmarks/scheduling.py measures what bucketing and prefetch add.
Theory for the weights kept between forward and backward: ZeRO-3 saves nothing but the shards it
holds anyway (M/W); hpZ adds the secondary shards, M_bw/hpz, where M_bw is the size of the weights
the backward needs (the weights of layers whose input gradient is needed) -- in int8 with qwZ.
Prints markdown and writes docs/hpz_memory.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    benchmark_parser,
    publish,
    reset_compiled_state,
    run_workers,
    step_peak_bytes,
    tracked,
)

CONFIGS = {
    "ZeRO-3": {},
    "hpZ": {"hpz": True},
    "qwZ": {"quantize_weights": True},
    "qwZ + hpZ (int8 secondary)": {"quantize_weights": True, "hpz": True},
    "qwZ + hpZ (dequantized secondary)": {"quantize_weights": True, "hpz": True, "hpz_quantized_secondary": False},
}


def _weights_saved_bytes(record) -> int:
    """Bytes of the backward inputs that are gathered: the weights kept from forward for backward."""
    from zpp_compile.passes.graph_utils import c10d

    inputs = {n.args[0] for n in record.backward.graph.nodes if n.target == c10d.all_gather_into_tensor.default}
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in inputs if n.op == "placeholder")


def measure(label: str, options: dict, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import zpp_compile
    from examples.gpt import GPT, GPTConfig
    from zpp_compile.backend import compiled_graphs

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256))
    config = zpp_compile.Config(
        ranks_per_node=args.ranks_per_node,
        hpz_size=args.hpz if options.get("hpz") else None,
        quantize_weights=options.get("quantize_weights", False),
        hpz_quantized_secondary=options.get("hpz_quantized_secondary", True),
        # One collective per parameter, issued where used: what hpZ changes, not what bucketing and
        # prefetch add (benchmarks/scheduling.py measures those).
        gather_bucket_bytes=0,
        reduce_bucket_bytes=0,
        prefetch_limit=0,
    )
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    zpp_compile.shard(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zeropp")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 512, (4, 65), generator=g)

    def step() -> None:
        compiled(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    counter = zpp_compile.comm_counter()
    counter.reset()
    peak = step_peak_bytes(step)
    record = [r for r in compiled_graphs() if r.backward is not None][-1]
    result = {
        "label": label,
        "world": world,
        "param_bytes": param_bytes,
        "saved_bytes": sum(t.numel() * t.element_size() for t in record.saved_for_backward),
        "weights_saved_bytes": _weights_saved_bytes(record),
        "step_peak_bytes": peak,
        "sent_inter": counter.bytes(direction="sent", locality="inter"),
        "sent_intra": counter.bytes(direction="sent", locality="intra"),
    }
    reset_compiled_state()
    return result


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = [measure(label, options, args) for label, options in tracked(CONFIGS.items(), "configs")]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def table(results: list[dict], args: argparse.Namespace) -> str:
    mb = 2**20
    m = results[0]["param_bytes"]
    plain_weights = results[0]["weights_saved_bytes"]  # primary shards of the weights backward needs
    lines = [
        f"`python benchmarks/hpz_memory.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--hpz {args.hpz}` (GPT {m / 4e6:.2f}M params = M = {m / mb:.1f} MB fp32, world {args.nproc}, "
        f"{args.nproc // args.ranks_per_node} simulated nodes; rank 0, one step after two warm-up steps; "
        "scheduling passes off, so the figures isolate hpZ)",
        "",
        f"M/W = {m / args.nproc / mb:.2f} MB per rank. The backward needs the weights of "
        f"M_bw = {plain_weights * args.nproc / mb:.2f} MB (fp32): hpZ theory "
        f"M_bw/hpz = {plain_weights * args.nproc / args.hpz / mb:.2f} MB (fp32), "
        f"{plain_weights * args.nproc / args.hpz / 4 / mb:.2f} MB + scales (int8).",
        "",
        "| config | weights saved for backward MB | all saved for backward MB | step peak MB | "
        "sent inter-node MB/step | sent intra-node MB/step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['weights_saved_bytes'] / mb:.2f} | {r['saved_bytes'] / mb:.2f} | "
            f"{r['step_peak_bytes'] / mb:.2f} | {r['sent_inter'] / mb:.2f} | {r['sent_intra'] / mb:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--hpz", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = run_workers(__file__, args.nproc, ["--ranks-per-node", str(args.ranks_per_node), "--hpz", str(args.hpz)])
    publish(table(results, args), "hpz_memory.md", "hpZ: memory and bytes per rank")


if __name__ == "__main__":
    main()
