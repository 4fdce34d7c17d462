"""A graph compiled with dynamic shapes saves no more for the backward than the same graph with
static shapes (passes/localize_constant_scalars.py): before, HF GPT-2 saved one more GELU
activation per layer but the first under dynamic shapes."""

from __future__ import annotations

import pytest
import torch

import zpp_compile
from zpp_compile.backend import clear_compiled_graphs, compiled_graphs

from .models import hf_gpt2, hf_llama

MODELS = {"hf_gpt2_3_layers": lambda: hf_gpt2(layers=3), "hf_llama": hf_llama}


def _hint(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def saved_bytes(name: str, dynamic: bool) -> list[tuple[int, str]]:
    """One step of MODELS[name] on a (2, 16) batch: the bytes each saved tensor of its
    graphs holds, at this batch's sizes, with the tensor's shape; one-element tensors left out
    (the dynamic graph also saves the GELU's float64 constant, 8 bytes)."""
    clear_compiled_graphs()
    torch.manual_seed(0)
    model = zpp_compile.shard(MODELS[name]())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.compile(model, backend="zeropp", dynamic=dynamic)(input_ids=tokens, labels=tokens).loss.backward()
    return [
        (_hint(t.numel()) * t.dtype.itemsize, str(tuple(t.shape)))
        for record in compiled_graphs()
        for t in record.saved_for_backward
        if _hint(t.numel()) > 1
    ]


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_shapes_save_no_more_for_the_backward_than_static_ones(pools, name):
    static, dynamic = (pools(2).run(saved_bytes, name, d)[0] for d in (False, True))
    assert sum(b for b, _ in dynamic) <= sum(b for b, _ in static), (static, dynamic)
    # GPT-2's GELU's (batch, sequence, 4 x width) activation: as many saved as under static shapes.
    gelu_wide = [b for b, _ in static if b == 2 * 16 * 128 * 4]
    assert len([b for b, _ in dynamic if b == 2 * 16 * 128 * 4]) <= len(gelu_wide), (static, dynamic)
