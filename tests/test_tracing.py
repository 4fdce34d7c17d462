"""What Dynamo does with a sharded model: the frames it traces are the unsharded model's (real
Dynamo, a one-rank gloo group)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import zpp_compile

from .models import batch, build, loss_of
from .workers import reset_process_state


def _frames_traced(model: torch.nn.Module, backend: str) -> dict[str, int]:
    """Dynamo's frame counts ("total": frames it began to trace, "ok": frames it compiled) for one
    forward of HF GPT-2 with labels: its loss breaks the graph (Hugging Face's logging)."""
    torch._dynamo.reset()
    counters.clear()
    x, _ = batch("hf_gpt2", 2, 0)
    loss_of("hf_gpt2", torch.compile(model, backend=backend), x, None)
    return dict(counters["frames"])


def test_dynamo_gives_up_no_frame_of_a_sharded_model(group_of_one):
    """The forward wrapper of a sharded module is never a frame of its own: traced, its try/finally
    made Dynamo give the frame up at the first graph break below it (Hugging Face's logging),
    after tracing the whole model once more for nothing."""
    torch.manual_seed(0)
    unsharded = _frames_traced(build("hf_gpt2"), "eager")
    try:
        model = zpp_compile.shard(build("hf_gpt2"), zpp_compile.Config(lowering="aot_eager"))
        sharded = _frames_traced(model, "zeropp")
    finally:
        reset_process_state()
    assert unsharded["total"] == unsharded["ok"], unsharded
    assert sharded["total"] == sharded["ok"] > 0, sharded


def test_a_sharded_torch_nn_module_compiled_by_itself_gives_the_unsharded_values(group_of_one):
    """Dynamo never traces torch.nn's own forwards as frames, and the forward wrapper is never
    one either: a sharded nn.Linear compiled by itself still computes what the unsharded layer
    does. (Inside a model the wrapper and the layer are inlined into the model's graph.)"""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    want = layer(x)
    try:
        model = zpp_compile.shard(layer, zpp_compile.Config(lowering="aot_eager"))
        got = torch.compile(model, backend="zeropp")(x)
    finally:
        reset_process_state()
    torch.testing.assert_close(got, want)
