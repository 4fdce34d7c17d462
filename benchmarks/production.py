"""Production features: mixed precision (bytes, step time, loss) and sharded checkpoints (time, size).

    python benchmarks/production.py [--nproc 4] [--ranks-per-node 2] [--steps 30]

Part 1 trains the GPT example compiled with the zeropp backend, world `nproc` in simulated nodes
of `ranks-per-node` (gloo), once per config, from the same initial weights and batches: fp32;
param_dtype=bf16 (reduce in bf16); bf16 with fp32 reduction; bf16 with qwZ + hpZ + qgZ. Per
config, rank 0: median step time, bytes it sent per step (inter-/intra-node, communication
counter), and the loss of the trained fp32 masters on held-out batches, evaluated in fp32 by an
unsharded copy (a bf16 training loss is itself rounded to bf16: 0.03 near 6).
Part 2 saves the fp32 run's model and AdamW state with zpp_compile.save_checkpoint at world
`nproc`, then loads it in a second launch at half the world size, and reports the save and load
times, the size on disk, and whether every parameter came back bitwise (full_state_dict before
the save against after the load).
Prints markdown and writes docs/production.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import benchmark_parser, publish, reset_compiled_state, run_workers, tracked  # noqa: E402
from examples.train_gpt import sample_batch  # noqa: E402

CONFIGS = {
    "fp32": {},
    "bf16 (param_dtype)": {"param_dtype": "bfloat16"},
    "bf16, fp32 reduce": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    "bf16 + qwZ + hpZ + qgZ": {
        "param_dtype": "bfloat16",
        "quantize_weights": True,
        "hpz": True,
        "quantize_gradients": True,
    },
}
GPT_SIZE = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)  # bytes of stdlib source


def _data():
    """Bytes of the standard library's source (examples/train_gpt.py): train on the first 95%."""
    from examples.train_gpt import load_stdlib_bytes

    data = load_stdlib_bytes(2.0)
    split = int(0.95 * data.numel())
    return data[:split], data[split:]


def _config(options: dict, args: argparse.Namespace):
    import torch

    import zpp_compile

    return zpp_compile.Config(
        ranks_per_node=args.ranks_per_node,
        param_dtype=getattr(torch, options["param_dtype"]) if "param_dtype" in options else None,
        reduce_dtype=getattr(torch, options["reduce_dtype"]) if "reduce_dtype" in options else None,
        quantize_weights=options.get("quantize_weights", False),
        hpz_size=args.ranks_per_node if options.get("hpz") else None,
        quantize_gradients=options.get("quantize_gradients", False),
    )


def _model_and_optimizer(config, lr: float = 1e-3):
    import torch

    import zpp_compile
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = zpp_compile.shard(GPT(GPTConfig(**GPT_SIZE)), config)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train(label: str, options: dict, args: argparse.Namespace) -> tuple[dict, object, object]:
    import torch
    import torch.distributed as dist

    import zpp_compile

    world, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _model_and_optimizer(_config(options, args), args.lr)
    compiled = torch.compile(model, backend="zeropp")
    counter = zpp_compile.comm_counter()
    train_data, val_data = _data()
    seconds, loss = [], None
    for step in tracked(range(args.steps), f"{label}: steps"):
        g = torch.Generator().manual_seed(step * world + rank)
        x, y = sample_batch(train_data, 4, GPT_SIZE["block_size"], g)
        counter.reset()
        started = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - started)
    result = {
        "label": label,
        "median_ms": 1e3 * statistics.median(seconds[3:]),
        "sent_inter": counter.bytes(direction="sent", locality="inter"),
        "sent_intra": counter.bytes(direction="sent", locality="intra"),
        "final_loss": _fp32_eval_loss(model, val_data),
    }
    return result, model, opt


def _fp32_eval_loss(model, val_data) -> float:
    """Mean loss of the model's fp32 masters on 8 fixed held-out batches, unsharded, in fp32."""
    import torch

    import zpp_compile
    from examples.gpt import GPT, GPTConfig

    reference = GPT(GPTConfig(**GPT_SIZE))
    reference.load_state_dict(zpp_compile.full_state_dict(model))
    g = torch.Generator().manual_seed(12345)
    batches = [sample_batch(val_data, 8, GPT_SIZE["block_size"], g) for _ in range(8)]
    with torch.no_grad():
        return sum(reference(x, y).item() for x, y in batches) / len(batches)


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def save_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zpp_compile

    dist.init_process_group("gloo")
    results = []
    for label, options in CONFIGS.items():
        result, model, opt = train(label, options, args)
        results.append(result)
        if label == "fp32":
            seconds = _timed(lambda: zpp_compile.save_checkpoint(args.checkpoint, model, opt))
            full = zpp_compile.full_state_dict(model)
            if dist.get_rank() == 0:
                torch.save(full, Path(args.checkpoint) / "expected_full_state_dict.pt")
            bytes_on_disk = sum(f.stat().st_size for f in Path(args.checkpoint).glob("*.distcp"))
            results.append({"save_s": seconds, "bytes_on_disk": bytes_on_disk, "world": dist.get_world_size()})
        reset_compiled_state()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def load_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zpp_compile

    dist.init_process_group("gloo")
    model, opt = _model_and_optimizer(_config({}, argparse.Namespace(ranks_per_node=dist.get_world_size())))
    seconds = _timed(lambda: zpp_compile.load_checkpoint(args.checkpoint, model, opt))
    expected = torch.load(Path(args.checkpoint) / "expected_full_state_dict.pt")
    loaded = zpp_compile.full_state_dict(model)
    bitwise = all(torch.equal(loaded[k], expected[k]) for k in expected)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"load_s": seconds, "bitwise": bitwise, "world": dist.get_world_size()}))
    dist.destroy_process_group()


def table(results: list[dict], loaded: dict, args: argparse.Namespace) -> str:
    mb = 2**20
    runs = [r for r in results if "label" in r]
    saved = next(r for r in results if "save_s" in r)
    base = runs[0]
    lines = [
        f"`python benchmarks/production.py --nproc {args.nproc} --ranks-per-node {args.ranks_per_node} "
        f"--steps {args.steps}` (GPT {GPT_SIZE}, world {args.nproc} in {args.nproc // args.ranks_per_node} "
        "simulated nodes on one 2-core machine, gloo over loopback; rank 0; median step after 3 warm-up "
        f"steps; lr {args.lr}; eval loss: the fp32 masters after the last step, unsharded, on 8 held-out "
        "batches of 64 bytes; all runs from the same weights and batches of stdlib source, 4 sequences per rank)",
        "",
        "## Mixed precision",
        "",
        "| config | median step ms | sent inter-node MB/step | sent intra-node MB/step | eval loss after "
        f"{args.steps} steps | loss / fp32 loss |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        lines.append(
            f"| {r['label']} | {r['median_ms']:.0f} | {r['sent_inter'] / mb:.2f} | {r['sent_intra'] / mb:.2f} | "
            f"{r['final_loss']:.4f} | {r['final_loss'] / base['final_loss']:.4f} |"
        )
    lines += [
        "",
        "## Sharded checkpoint (model + AdamW state, fp32 run)",
        "",
        "| saved at world | save s | size on disk MB | loaded at world | load s | parameters bitwise equal |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {saved['world']} | {saved['save_s']:.2f} | {saved['bytes_on_disk'] / mb:.2f} | {loaded['world']} | "
        f"{loaded['load_s']:.2f} | {'yes' if loaded['bitwise'] else 'NO'} |",
    ]
    return "\n".join(lines)


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return (load_worker if args.load else save_worker)(args)
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--ranks-per-node", str(args.ranks_per_node), "--steps", str(args.steps), "--lr", str(args.lr),
                  "--checkpoint", tmp]  # fmt: skip
        results = run_workers(__file__, args.nproc, common)
        loaded = run_workers(__file__, max(1, args.nproc // 2), [*common, "--load"])
    publish(table(results, loaded, args), "production.md", "Mixed precision and sharded checkpoints")


if __name__ == "__main__":
    main()
