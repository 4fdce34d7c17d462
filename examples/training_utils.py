"""The parts of examples/train_gpt.py that are not about zpp_compile: data, models, the learning-rate
schedule, the micro-batch loop, meters, the first-step notice, the progress bar and the plot.

Plain PyTorch (and optionally Hugging Face transformers, tqdm, matplotlib); importable on its own,
and shared with the benchmarks (benchmarks/_common.py re-exports `progress`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
import math
import resource
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --------------------------------------------------------------------------------------- data


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
    """`batch` random windows of block + 1 bytes: inputs x = window[:-1], targets y = window[1:]."""
    starts = sample_starts(data, batch, block, gen)
    window = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------- models

MODELS = ("gpt", "hf-gpt2", "hf-llama")
# loss_fn(run, x, y): the mean next-byte cross-entropy of the (compiled or eager) model `run` on
# inputs x and targets y = x shifted by one, [batch, block] each.
LossFn = Callable[[Callable[..., Any], Tensor, Tensor], Tensor]


def build_model(
    kind: str, *, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float = 0.0
) -> tuple[nn.Module, LossFn]:
    """A freshly initialised byte-level model (vocabulary 256) and its loss function.

    "gpt" is examples/gpt.py. "hf-gpt2" / "hf-llama" are Hugging Face GPT2LMHeadModel /
    LlamaForCausalLM built from a config of the same size (nothing downloaded; `dropout` is the
    Hugging Face models' dropout probability everywhere, off by default as in the GPT, which has
    none; GPT-2's own default is 0.1). Every model is scored on the same targets: the cross-entropy of the logits at each of
    the `block` positions against the next byte, so the three losses are comparable.
    """
    if kind == "gpt":
        from examples.gpt import GPT, GPTConfig

        if dropout:
            raise ValueError("examples/gpt.py has no dropout: use --model hf-gpt2 or hf-llama with --dropout")

        cfg = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        return GPT(cfg), lambda run, x, y: run(x, y)
    if kind == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=256, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
        )  # fmt: skip
        return GPT2LMHeadModel(config), hf_loss
    if kind == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=256, hidden_size=n_embd, intermediate_size=_llama_ffn(n_embd), num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_head, max_position_embeddings=block_size,
            bos_token_id=0, eos_token_id=0, use_cache=False, attention_dropout=dropout,
        )  # fmt: skip
        return LlamaForCausalLM(config), hf_loss
    raise ValueError(f"unknown model {kind!r}; choose one of {MODELS}")


def hf_loss(run: Callable[..., Any], x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of a Hugging Face causal LM on the same targets as the GPT's.

    The model's own `labels=` path shifts the labels inside: given `labels=x` it scores the
    block - 1 positions that have a next byte inside x and drops the last one. The targets y
    (= x shifted by one, the next byte of every position) are at hand, so score all `block`
    positions directly, in fp32 as Hugging Face's loss does."""
    logits = run(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _llama_ffn(n_embd: int) -> int:
    """Llama's SwiGLU width: 8/3 of the model width (as many weights as a 4x GELU MLP), a multiple of 32."""
    return 32 * math.ceil(8 * n_embd / 3 / 32)


# -------------------------------------------------------------------------- schedule and step


def lr_at(step: int, *, base_lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate of 1-based `step`: linear warmup from base_lr / warmup to base_lr over the
    first `warmup` steps, then cosine decay to min_lr at step `total` (min_lr after it)."""
    if step <= warmup:
        return base_lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (base_lr - min_lr)


def forward_backward(
    run: Callable[..., Any],
    loss_fn: LossFn,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    no_sync: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> Tensor:
    """Forward and backward over the micro-batches of one optimizer step (gradient accumulation);
    returns their mean loss, detached.

    Each micro-batch's loss is divided by their number before backward(), so the accumulated
    gradient is that of the mean loss. The first K-1 backward passes run inside `no_sync()`: a
    context that defers the gradient reduction to the last micro-batch, e.g.
    `lambda: zpp_compile.no_sync(model)` (model: the sharded module, or its compiled wrapper). With
    the default (no context) every backward reduces its gradients, which is plain accumulation.
    """
    k = len(micro_batches)
    total: Optional[Tensor] = None
    for i, (x, y) in enumerate(micro_batches):
        with no_sync() if i < k - 1 else contextlib.nullcontext():
            loss = loss_fn(run, x, y)
            (loss / k).backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    assert total is not None, "no micro-batches"
    return total / k


# ----------------------------------------------------------------------------------- meters


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most bytes the caching allocator handed out (torch.cuda.max_memory_allocated).
    CPU: this process's peak resident set size (getrusage; Linux reports KiB, macOS bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclasses.dataclass
class StepRecord:
    """One optimizer step, as logged. Steps restored from a checkpoint's history carry only
    step, loss, lr and grad_norm (the rest is None)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mem_bytes: Optional[int] = None
    sent_intra: Optional[int] = None  # bytes this rank sent in the step, inside its node
    sent_inter: Optional[int] = None  # and to other nodes

    def log_line(self, total_steps: int) -> str:
        mb = 1e6
        return (
            f"step {self.step:{len(str(total_steps))}d}/{total_steps} | loss {self.loss:.4f} | "
            f"lr {self.lr:.2e} | grad norm {self.grad_norm:.3f} | {self.seconds * 1e3:7.1f} ms/step | "
            f"{self.tokens_per_s:8.0f} tok/s | peak mem {self.peak_mem_bytes / mb:.0f} MB | "
            f"sent intra {self.sent_intra / mb:.2f} MB, inter {self.sent_inter / mb:.2f} MB /rank/step"
        )


HISTORY_COLUMNS = ("step", "loss", "lr", "grad_norm")  # what a checkpoint keeps of earlier steps


def history_tensor(records: Sequence[StepRecord]) -> Tensor:
    """The loss curve so far as a [steps, 4] float64 tensor (equal on every rank), for a checkpoint."""
    return torch.tensor([[getattr(r, c) for c in HISTORY_COLUMNS] for r in records], dtype=torch.float64)


def records_from_history(history: Optional[Tensor], up_to_step: int) -> list[StepRecord]:
    if history is None or history.numel() == 0:
        return []
    rows = history.reshape(-1, len(HISTORY_COLUMNS)).tolist()
    return [StepRecord(int(s), loss, lr, g) for s, loss, lr, g in rows if s <= up_to_step]


def write_csv(path: Path, records: Sequence[StepRecord]) -> None:
    """One row per step: step, loss, step_seconds, lr, grad_norm, tokens_per_s, peak_mem_mb,
    sent_intra_mb, sent_inter_mb (empty where a resumed run restored only the loss curve)."""

    def num(value: Optional[float], fmt: str, scale: float = 1.0) -> str:
        return "" if value is None else format(value / scale, fmt)

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "step_seconds", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb",
                         "sent_intra_mb", "sent_inter_mb"])  # fmt: skip
        for r in records:
            writer.writerow([r.step, f"{r.loss:.6f}", num(r.seconds, ".4f"), f"{r.lr:.6g}", f"{r.grad_norm:.6g}",
                             num(r.tokens_per_s, ".0f"), num(r.peak_mem_bytes, ".1f", 1e6),
                             num(r.sent_intra, ".4f", 1e6), num(r.sent_inter, ".4f", 1e6)])  # fmt: skip


# ------------------------------------------------------------------------------ notices, plots


class FirstStepNotice:
    """Says "compiling (first step)..." before the first step and then, from a daemon thread,
    every `every` seconds how long it has been running, until the step returns.

    A context manager; does nothing when not `enabled` (ranks other than 0)."""

    def __init__(self, label: str, enabled: bool, every: float = 10.0, write: Callable[[str], None] = print) -> None:
        self.label, self.enabled, self.every, self.write = label, enabled, every, write
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self._done = False
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> FirstStepNotice:
        self._start = time.perf_counter()
        if self.enabled:
            self.write(f"{self.label}...")
            self._schedule()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        with self._lock:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
        if self.enabled and exc[0] is None:
            self.write(f"{self.label}: done in {self.seconds:.1f} s")

    def _schedule(self) -> None:
        self._timer = threading.Timer(self.every, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            if self._done:
                return
            self.write(f"{self.label}... {time.perf_counter() - self._start:.0f} s")
            self._schedule()


def plot_loss_curve(
    records: Sequence[StepRecord], path: Path, title: str, val: Optional[tuple[int, float]] = None
) -> Optional[str]:
    """Write the training loss (and the learning rate, on a second axis) against the step to a
    PNG. Returns None when written, else why not (matplotlib, an optional extra, is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install matplotlib, or the project's [examples] extra"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in records]
    ax.plot(steps, [r.loss for r in records], linewidth=1, label="train loss (world mean)")
    if val is not None:
        ax.plot([val[0]], [val[1]], "o", label=f"validation loss {val[1]:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r.lr for r in records], color="gray", linewidth=0.8, linestyle="--", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


@contextlib.contextmanager
def compile_times_logged(write: Callable[[str], None], enabled: bool) -> Iterator[None]:
    """Route zpp_compile's INFO lines on each graph's compile time per stage (logger
    "zpp_compile.compile_time") to `write` while the block runs; nothing when not `enabled`."""
    logger = logging.getLogger("zpp_compile.compile_time")
    if not enabled:
        yield
        return
    handler = _CallbackHandler(write)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


class _CallbackHandler(logging.Handler):
    def __init__(self, write: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        self.write(self.format(record))


# -------------------------------------------------------------------------------- progress bar


def progress(total: int, enabled: bool = True, desc: Optional[str] = None) -> Any:
    """A progress bar over `total` units: tqdm's when tqdm is installed (an optional extra), else
    PlainProgress. Both have update(n), set_postfix(**kw), set_description(s), write(line) and
    close(), and work as context managers. Disabled, it prints nothing (ranks other than 0),
    except write(), which also prints nothing then."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, enabled, desc)
    return tqdm(total=total, disable=not enabled, desc=desc, dynamic_ncols=True)


class PlainProgress:
    """Progress as plain lines on stderr, about every tenth of the way; write() prints to stdout."""

    def __init__(self, total: int, enabled: bool = True, desc: Optional[str] = None) -> None:
        self.total, self.enabled, self.desc = total, enabled, desc
        self.n = 0
        self.postfix = ""
        self._next = 0
        self._start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled and (self.n >= self._next or self.n >= self.total):
            self._next = self.n + max(1, self.total // 10)
            elapsed = time.perf_counter() - self._start
            desc = f"{self.desc}: " if self.desc else ""
            print(f"{desc}{self.n}/{self.total} ({elapsed:.0f} s){self.postfix}", file=sys.stderr, flush=True)

    def set_postfix(self, **kwargs: object) -> None:
        self.postfix = "".join(f", {k}={v}" for k, v in kwargs.items())

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def write(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
