"""Tiny models that exercise the awkward cases: uneven sizes, scalars, frozen and tied parameters."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import zpp_compile
from examples.gpt import GPT, GPTConfig
from zpp_compile.codegen.quantize import dequantize_int8_blocks, quantize_int8_blocks
from zpp_compile.layout import ShardSpec, shard_spec
from zpp_compile.sharding import local_chunk, padded_flat_chunk

TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


class OddMLP(nn.Module):
    """Uneven parameter sizes (none divides 4 or 8), a scalar, a frozen layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 29)
        self.frozen = nn.Linear(29, 29)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(29, 7)
        self.scale = nn.Parameter(torch.tensor(0.75))
        self.register_buffer("shift", torch.linspace(-1, 1, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = h + torch.tanh(self.frozen(h))
        return self.fc2(h) * self.scale + self.shift


class BrokenMLP(nn.Module):
    """Two Dynamo graphs (an explicit graph break), with `scale` used in both of them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 29)
        self.fc2 = nn.Linear(29, 7)
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x)) * self.scale
        torch._dynamo.graph_break()
        return self.fc2(h) * self.scale


class NoGradNormMLP(nn.Module):
    """Reads fc.weight once under no_grad (a norm for logging) and once for real: the two gathers
    must not be merged, or fc.weight loses its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(13, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norm = self.fc.weight.norm()
        return self.fc(x) / (1 + norm)


class CheckpointedMLP(nn.Module):
    """OddMLP under activation checkpointing: the backward recomputes the forward, gathers included."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = OddMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class ShortMLP(nn.Module):
    """Layers shorter than the world along dim 0 (3 rows): at world 4 one rank holds no rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 3)
        self.fc2 = nn.Linear(3, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class BreakInBlocksGPT(GPT):
    """The tiny GPT with a graph break inside its loop over blocks (between attention and MLP)."""

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = x + block.attn(block.ln_1(x))
            torch._dynamo.graph_break()
            x = x + block.fc_proj(F.gelu(block.fc(block.ln_2(x))))
        logits = self.lm_head(self.ln_f(x))  # lm_head.weight is tied to wte.weight, read in graph 1
        print(end="")  # a graph break in the loss as well
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class BreakAroundReadMLP(OddMLP):
    """A weight read before a graph break and used after it: the gathered weight leaves the first
    graph as an output; the frozen layer is read across the break too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, frozen_w = self.fc1.weight, self.frozen.weight
        torch._dynamo.graph_break()
        h = F.gelu(F.linear(x, w, self.fc1.bias))
        h = h + torch.tanh(F.linear(h, frozen_w, self.frozen.bias))
        return self.fc2(h) * self.scale + self.shift


class RandomOpsMLP(nn.Module):
    """Every random op a model may use, in forward: dropout, rand, randn, bernoulli, randint,
    randperm. A keyword-only forward, and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 29)
        self.fc2 = nn.Linear(29, 7)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("noise_scale", torch.tensor(0.05), persistent=False)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.fc1(x)))
        h = h + (torch.rand_like(h) + torch.randn(h.shape)) * self.noise_scale
        h = h * torch.bernoulli(torch.full_like(h, 0.8))
        h = h[:, torch.randperm(h.shape[-1])]
        return self.fc2(h) + torch.randint(0, 3, (1,)).float()


class ConvNet(nn.Module):
    """Convolutions: Inductor's layout optimization (channels-last on CPU with mkldnn) makes the
    compiled forward save activations in strides other than those AOTAutograd traced."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


class BatchNormNet(ConvNet):
    """ConvNet with BatchNorm: a forward that updates buffers (running statistics) from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(8)
        self.norm2 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))
        return self.head(h.mean(dim=(2, 3)))


def hf_gpt2(dropout: float = 0.0, vocab: int = 64, width: int = 32, layers: int = 2) -> nn.Module:
    """A tiny Hugging Face GPT-2 from a config (nothing downloaded); GPT-2's default dropout is 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=width, n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class LayerFrames(nn.Module):
    """The same layer class outside the blocks and in each. The graph break in the loop makes
    Dynamo run the model's own frame eagerly and compile _Layer.forward as a frame of its own,
    first for `proj` (outside the blocks), then for the blocks: small graphs Inductor compiles
    whole, each with one bucketed all-gather per phase."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = _Layer()
        self.blocks = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x


def hf_llama() -> nn.Module:
    """A tiny Hugging Face Llama from a config: RMSNorm, rotary buffers, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


HF_MODELS = ("hf_gpt2", "hf_llama")  # without dropout: they train like their unsharded copies
TOKEN_MODELS = ("gpt", "deep_gpt", "break_gpt", *HF_MODELS, "hf_gpt2_dropout", "hf_gpt2_uneven")


def build(name: str) -> nn.Module:
    models = {
        "mlp": OddMLP,
        "conv": ConvNet,
        "batchnorm": BatchNormNet,
        "short_mlp": ShortMLP,
        "broken_mlp": BrokenMLP,
        "ckpt_mlp": CheckpointedMLP,
        "no_grad_mlp": NoGradNormMLP,
        "gpt": lambda: GPT(TINY_GPT),
        # Six wider blocks: hpZ's secondary shards outweigh a gather's buffers (tests/test_auto_plan.py).
        "deep_gpt": lambda: GPT(dataclasses.replace(TINY_GPT, n_layer=6, n_embd=96)),
        "break_gpt": lambda: BreakInBlocksGPT(TINY_GPT),
        "break_read_mlp": BreakAroundReadMLP,
        "random_mlp": RandomOpsMLP,
        "hf_gpt2": hf_gpt2,
        "hf_gpt2_dropout": lambda: hf_gpt2(dropout=0.1),
        # 65 embedding rows: sharded by rows, padded at 2 ranks and at 4.
        "hf_gpt2_uneven": lambda: hf_gpt2(vocab=65, width=30),
        "hf_llama": hf_llama,
    }
    return models[name]()


def batch(name: str, global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: identical on every rank (each rank takes its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in TOKEN_MODELS:
        tokens = torch.randint(0, TINY_GPT.vocab_size, (global_batch, TINY_GPT.block_size + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    if name in ("conv", "batchnorm"):
        return torch.randn(global_batch, 3, 8, 8, generator=g), torch.randn(global_batch, 7, generator=g)
    return torch.randn(global_batch, 13, generator=g), torch.randn(global_batch, 7, generator=g)  # the MLPs


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "deep_gpt", "break_gpt"):
        return model(x, y)
    if name.startswith("hf_"):  # Hugging Face shifts the labels itself
        return model(input_ids=x, labels=x).loss
    if name == "random_mlp":
        return F.mse_loss(model(x=x), y)
    return F.mse_loss(model(x), y)


def peak_bytes_during(work) -> int:
    """The most bytes allocated at once while work() runs, over what was live before it (the
    profiler's memory records: CPU has no allocator statistics)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    records = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda r: r.start_ns()
    )
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def quantize_dequantize_per_shard(full: torch.Tensor, spec: ShardSpec, block: int) -> torch.Tensor:
    """What every rank sees after an int8 gather: each rank's padded part quantized on its own."""
    pieces = []
    for r in range(spec.group_size):
        q, scale = quantize_int8_blocks(padded_flat_chunk(local_chunk(full, spec, r), spec), block)
        pieces.append(dequantize_int8_blocks(q, scale, full.dtype)[: spec.shard_numel])
    return torch.cat(pieces)[: spec.numel].view(full.shape)


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of a sharded parameter's gradient, as a plain tensor."""
    return param.grad.to_local()


def loss_curve(
    config: zpp_compile.Config, steps: int, lr: float = 3e-3, grads: Optional[list] = None, model: str = "gpt"
) -> tuple[list[float], nn.Module]:
    """Train the model `model` (seed 0; the tiny GPT by default) sharded with `config`, compiled,
    for `steps` AdamW steps on this rank's slice of the global batches; return the losses and the
    (sharded) model. With `grads`, append each step's gradient shards to it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    sharded = zpp_compile.shard(build(model), config)
    opt = torch.optim.AdamW(sharded.parameters(), lr=lr)
    compiled = torch.compile(sharded, backend="zeropp")
    losses = []
    for step in range(steps):
        x, y = batch(model, 4 * world, step)
        loss = loss_of(model, compiled, x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        if grads is not None:
            grads.append([local_grad(p).clone() for p in sharded.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, sharded


def sharded_with_reference(name: str, mode: str, config: zpp_compile.Config, lr: float = 1e-2):
    """The model `name` (seed 0) and an unsharded copy of it; the model sharded with `config` and
    run eagerly (mode "eager") or compiled; AdamW on the trainable parameters of each.

    Returns (sharded model, what to call it through, its optimizer, reference, reference optimizer).
    """
    torch.manual_seed(0)
    model = build(name)
    reference = copy.deepcopy(model)
    zpp_compile.shard(model, config)
    run = model if mode == "eager" else torch.compile(model, backend="zeropp")
    return model, run, _adamw(model, lr), reference, _adamw(reference, lr)


def _adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def lowering_of(mode: str) -> str:
    """Config.lowering for a test mode ("eager" / "inductor" / "aot_eager")."""
    return "aot_eager" if mode == "aot_eager" else "inductor"


def gradient_errors(sharded: nn.Module, reference: nn.Module, step: int) -> dict[str, float]:
    """This rank's gradient shards against the same slice of the reference gradients.

    Errors are relative to the norm of the whole reference gradient: a scalar's gradient is a sum
    with cancellation, so its own norm is no scale.
    """
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    scale = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
    errors = {}
    for (name, p), ref in zip(sharded.named_parameters(), reference.parameters()):
        if p.requires_grad:
            expected = local_chunk(ref.grad, shard_spec(p), dist.get_rank())
            errors[f"step {step} grad {name}"] = (local_grad(p) - expected).norm().item() / scale
    return errors


def sharding_error(config: zpp_compile.Config) -> str:
    """The ShardingError shard() raises for the tiny GPT under `config` ("no error" if none)."""
    from .workers import reset_process_state

    try:
        zpp_compile.shard(build("gpt"), config)
    except zpp_compile.ShardingError as e:
        return str(e)
    finally:
        reset_process_state()
    return "no error"


@contextlib.contextmanager
def torchrun_environment() -> Iterator[None]:
    """The variables torchrun sets for a worker of the pool (what Hugging Face Trainer and
    Accelerate read to find the process group), restored afterwards."""
    launch = {"RANK": dist.get_rank(), "LOCAL_RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size()}
    launch["LOCAL_WORLD_SIZE"] = launch["WORLD_SIZE"]
    saved = {var: os.environ.get(var) for var in launch}
    os.environ.update({var: str(value) for var, value in launch.items()})
    _reset_accelerate()
    try:
        yield
    finally:
        _reset_accelerate()
        for var, value in saved.items():
            if value is None:
                del os.environ[var]
            else:
                os.environ[var] = value


def _reset_accelerate() -> None:
    """Accelerate keeps one process state per process, and a pool worker may hold another rank in
    the next test: without a reset its main process can be the wrong rank."""
    import sys  # noqa: PLC0415

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def trainer_dataset() -> list[dict[str, torch.Tensor]]:
    """16 sequences of 16 tokens for Hugging Face Trainer, labels = inputs."""
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16), generator=g)]
