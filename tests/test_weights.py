"""Pretrained weights streamed into a meta-sharded model: each rank reads only its rows, from a
Hugging Face safetensors folder (one file or a sharded index) or a full state dict; the result is
what from_pretrained gives, and a source that does not fit is refused naming the entries."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zpp_compile

from .models import build, peak_bytes_during


def _save_pretrained_once(name: str, folder: str, max_shard_size: str) -> None:
    if dist.get_rank() == 0:
        torch.manual_seed(3)
        build(name).save_pretrained(folder, max_shard_size=max_shard_size)
    dist.barrier()


def load_pretrained(name: str, folder: str, max_shard_size: str, keep_whole: int = 0) -> dict:
    _save_pretrained_once(name, folder, max_shard_size)
    reference = type(build(name)).from_pretrained(folder)
    with torch.device("meta"):
        model = build(name)
    zpp_compile.shard(model, zpp_compile.Config(keep_whole_numel=keep_whole))
    peak = peak_bytes_during(lambda: zpp_compile.load_safetensors(model, folder))
    full = zpp_compile.full_state_dict(model)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        same_output = torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)
    params = list(reference.parameters())
    return {
        "differ": [k for k, v in reference.state_dict().items() if not torch.equal(full[k], v)],
        "same_output": same_output,  # buffers (rotary tables) too
        "peak": peak,
        "bound": sum(p.to_local().numel() * 4 for p in model.parameters()) + max(p.numel() * 4 for p in params),
    }


@pytest.mark.parametrize("max_shard_size", ["1GB", "20KB"], ids=["one_file", "sharded_index"])
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_safetensors_load_into_a_meta_sharded_model_equals_from_pretrained(pools, tmp_path, name, max_shard_size):
    for r in pools(2).run(load_pretrained, name, str(tmp_path / "hf"), max_shard_size):
        assert r["differ"] == [] and r["same_output"], r
        assert r["peak"] <= r["bound"], r  # this rank's shards plus one parameter's rows, at most


def test_parameters_kept_whole_load_whole_on_every_rank(pools, tmp_path):
    for r in pools(2).run(load_pretrained, "hf_llama", str(tmp_path / "hf"), "1GB", 1000):
        assert r["differ"] == [] and r["same_output"], r
        assert r["peak"] <= r["bound"], r


def full_state_dict_stream() -> dict:
    torch.manual_seed(3)
    source = build("gpt").state_dict()
    with torch.device("meta"):
        model = build("gpt")
    zpp_compile.shard(model)
    # Each tensor is made only when drawn (as a reader of a file would), so the generator itself
    # holds one at a time; what the load keeps is measured.
    pairs = ((k, v.clone()) for k, v in source.items())
    peak = peak_bytes_during(lambda: zpp_compile.load_full_state_dict(model, pairs))
    full = zpp_compile.full_state_dict(model)
    shards = sum(t.to_local().numel() * 4 for t in model.state_dict().values())
    return {
        "differ": [k for k, v in source.items() if not torch.equal(full[k], v)],
        "peak": peak,
        # this rank's shards and buffers, plus the one full tensor in flight and its clone's source row slice
        "bound": shards + 2 * max(v.numel() * 4 for v in source.values()),
        "all_at_once": sum(v.numel() * 4 for v in source.values()),
    }


def test_a_full_state_dict_streams_in_parameter_by_parameter(pools):
    for r in pools(2).run(full_state_dict_stream):
        assert r["differ"] == [], r
        assert r["peak"] <= r["bound"] < r["all_at_once"], r


def mismatches() -> list[str]:
    torch.manual_seed(3)
    good = build("gpt").state_dict()
    messages = []
    for label, broken in (
        ("missing", {k: v for k, v in good.items() if k != "blocks.0.fc.bias"}),
        ("extra", {**good, "blocks.9.fc.bias": torch.zeros(4)}),
        ("shape", {**good, "ln_f.weight": torch.zeros(7)}),
    ):
        with torch.device("meta"):
            model = build("gpt")
        zpp_compile.shard(model)
        try:
            zpp_compile.load_full_state_dict(model, broken)
            messages.append(f"{label}: no error")
        except zpp_compile.CheckpointMismatchError as error:
            messages.append(f"{label}: {error}")
    return messages


def test_a_source_that_does_not_fit_is_refused_naming_the_entries(pools):
    missing, extra, shape = pools(2).run(mismatches)[0]
    assert "missing from the source: ['blocks.0.fc.bias']" in missing
    assert "in the source but not in the model: ['blocks.9.fc.bias']" in extra
    assert "ln_f.weight: the source has (7,), the model (32,)" in shape
