"""Meta-device initialization: shard a model that was never allocated, then materialize only this
rank's chunks; the values equal the same initialization of the unsharded model, and a rank holds
its shards plus one unsharded parameter at most."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zpp_compile
from examples.gpt import _init_weights

from .models import build, peak_bytes_during


def _gpt_init(model: nn.Module) -> None:
    """What GPT's constructor does: each module's reset_parameters() in order, then _init_weights."""
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    model.apply(_init_weights)


def _hf_init(model: nn.Module) -> None:
    model.init_weights()


INITS = {"gpt": _gpt_init, "hf_gpt2": _hf_init, "hf_llama": _hf_init}


def unsharded_reference(name: str) -> dict[str, torch.Tensor]:
    """The same initialization run on the unsharded model: GPT's constructor; Hugging Face's
    init_weights() after to_empty (ties restored, as from_pretrained does)."""
    torch.manual_seed(4)
    if name == "gpt":
        return build(name).state_dict()
    with torch.device("meta"):
        model = build(name)
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(4)
    model.init_weights()
    return {**model.state_dict(), **dict(model.named_buffers())}


def meta_init(name: str, keep_whole: int) -> dict:
    with torch.device("meta"):
        model = build(name)
    zpp_compile.shard(model, zpp_compile.Config(keep_whole_numel=keep_whole))
    torch.manual_seed(4)
    zpp_compile.materialize(model, init=INITS[name])
    full = zpp_compile.full_state_dict(model) | {n: b for n, b in model.named_buffers()}
    expected = unsharded_reference(name)
    x = torch.randint(0, 64, (2, 16))
    trains = torch.compile(model, backend="zeropp")(x, x) if name == "gpt" else model(input_ids=x, labels=x).loss
    trains.backward()
    return {
        "differ": [k for k, v in expected.items() if not torch.equal(full[k], v)],
        "trained": all(p.grad is not None for p in model.parameters()),
    }


@pytest.mark.parametrize(
    "name, keep_whole", [("gpt", 0), ("hf_gpt2", 0), ("hf_llama", 0), ("gpt", 1000), ("hf_llama", 1000)]
)  # 1000: biases and norms kept whole on every rank (Config.keep_whole_numel)
def test_meta_initialization_gives_the_unsharded_values(pools, name, keep_whole):
    for result in pools(2).run(meta_init, name, keep_whole):
        assert result["differ"] == [] and result["trained"], result


class HalfInitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.extra = nn.Parameter(torch.empty(3, 5))  # no reset_parameters() writes it


def unwritten() -> str:
    with torch.device("meta"):
        model = HalfInitialized()
    zpp_compile.shard(model)
    try:
        zpp_compile.materialize(model)
    except zpp_compile.ShardingError as error:
        return str(error)
    return "no error"


def test_a_parameter_no_initializer_wrote_is_named(pools):
    for message in pools(2).run(unwritten):
        assert "['extra'] unwritten" in message, message


def init_peak_bytes() -> dict[str, int]:
    """Peak bytes allocated while materializing a GPT on the meta device, against its shard state
    and its largest parameter (every rank), and against building it unsharded."""
    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=256)
    with torch.device("meta"):
        model = GPT(config)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    zpp_compile.shard(model)
    peak = peak_bytes_during(lambda: zpp_compile.materialize(model, init=_gpt_init))
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    unsharded = peak_bytes_during(lambda: GPT(config))
    return {"peak": peak, "shards": shard_bytes, "largest": largest, "unsharded": unsharded}


def test_materializing_holds_the_shards_plus_one_parameter(pools):
    for r in pools(4).run(init_peak_bytes):
        # Measured: the shards plus one full draw of the largest parameter (random init draws it
        # whole) plus small temporaries; the unsharded model is ~4x the shards at world 4.
        assert r["peak"] <= r["shards"] + 1.25 * r["largest"], r
        assert r["peak"] < 0.5 * r["unsharded"], r
