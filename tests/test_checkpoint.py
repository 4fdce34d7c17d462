"""Sharded checkpoints: state dicts and torch.distributed.checkpoint, resharded across world sizes."""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import zpp_compile
from zpp_compile.layout import int8_payload, shard_spec

from .models import OddMLP, batch, build, loss_of

# Fixed link and compute rates: shard() then measures nothing, and every run schedules alike.
RATES = dict(intra_node_gbps=10.0, inter_node_gbps=10.0, compute_tflops=0.1)
LOCAL_BATCH = 2


def _config(**kwargs) -> zpp_compile.Config:
    return zpp_compile.Config(lowering="aot_eager", **RATES, **kwargs)


def _optimizer(model: nn.Module, lr: float = 1e-2, weight_decay: float = 0.1) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)


def _train(name: str, run: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in steps:
        x, y = batch(name, LOCAL_BATCH * world, step)
        loss = loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_optimizer_state(opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every state tensor, DTensor ones all-gathered to the parameter's full shape (collective)."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            out[shard_spec(p).fqn] = {
                key: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
                for key, value in opt.state[p].items()
            }
    return out


def _hyper_parameters(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _report(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": zpp_compile.full_state_dict(model),
        "optim": _full_optimizer_state(opt),
        "groups": _hyper_parameters(opt),
    }


def train_and_save(name: str, path: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name), _config())
    opt = _optimizer(model)
    _train(name, model, opt, range(steps))
    with zpp_compile.comm_counter().trace() as issued:
        zpp_compile.save_checkpoint(path, model, opt, extra={"step": steps, "note": "hello"})
    assert not issued, f"saving gathered parameters: {issued}"  # each rank writes its own elements
    return _report(model, opt)


def load_fresh(name: str, path: str) -> dict:
    """A model initialised differently and an optimizer with other hyper-parameters and no state."""
    torch.manual_seed(1)
    model = zpp_compile.shard(build(name), _config())
    opt = _optimizer(model, lr=0.5, weight_decay=0.0)
    before = zpp_compile.full_state_dict(model)
    with zpp_compile.comm_counter().trace() as issued:
        extra = zpp_compile.load_checkpoint(path, model, opt)
    assert not issued, f"loading gathered parameters: {issued}"
    return _report(model, opt) | {"extra": extra, "before": before}


def load_export(name: str, export_path: str) -> dict:
    """The unsharded export (dcp_to_torch_save) loaded with the plain, non-DCP functions."""
    export = torch.load(export_path, weights_only=False)
    torch.manual_seed(1)
    model = zpp_compile.shard(build(name), _config())
    opt = _optimizer(model, lr=0.5, weight_decay=0.0)
    model.load_state_dict(export["model"])
    zpp_compile.load_optimizer_state_dict(model, opt, export["optim"])
    return _report(model, opt)


def _assert_bitwise(expected: dict, actual: dict, what: str) -> None:
    assert expected.keys() == actual.keys(), what
    for key in expected:
        if isinstance(expected[key], dict):
            _assert_bitwise(expected[key], actual[key], f"{what}.{key}")
        else:
            assert expected[key].dtype == actual[key].dtype, f"{what}.{key}"
            assert torch.equal(expected[key], actual[key]), f"{what}.{key} differs"


@pytest.mark.parametrize(
    "name, save_world, load_world", [("gpt", 4, 2), ("mlp", 2, 4)], ids=["gpt_4_to_2", "mlp_2_to_4"]
)
def test_a_checkpoint_saved_at_one_world_size_loads_bitwise_at_another(pools, tmp_path, name, save_world, load_world):
    # The MLP has a 0-d parameter (empty on ranks 1-3 at world 4), uneven sizes, a frozen layer
    # (no optimizer state) and a buffer; the GPT has tied embeddings.
    path = str(tmp_path / "ckpt")
    saved = pools(save_world).run(train_and_save, name, path, 2)[0]
    loaded = pools(load_world).run(load_fresh, name, path)
    first = next(iter(saved["params"]))
    for rank, got in enumerate(loaded):
        assert not torch.equal(got["before"][first], saved["params"][first])  # a no-op load would fail
        _assert_bitwise(saved["params"], got["params"], f"rank {rank} params")
        _assert_bitwise(saved["optim"], got["optim"], f"rank {rank} optimizer state")
        assert got["groups"] == saved["groups"]  # lr, weight_decay, betas... from the checkpoint
        assert got["extra"] == {"step": 2, "note": "hello"}

    # The checkpoint is an ordinary DCP one: exported, it is the unsharded state dict.
    dcp_to_torch_save(path, tmp_path / "export.pt")
    export = torch.load(tmp_path / "export.pt", weights_only=False)
    _assert_bitwise(saved["params"], export["model"], "exported params")
    _assert_bitwise({fqn: s for fqn, s in saved["optim"].items() if s}, export["optim"]["state"], "exported optimizer")
    if name == "gpt":  # tied: saved under both names, once as optimizer state (the first name)
        assert torch.equal(export["model"]["wte.weight"], export["model"]["lm_head.weight"])
        assert "lm_head.weight" not in export["optim"]["state"]

    # And that export loads back (at the saving world size) without DCP.
    for rank, got in enumerate(pools(save_world).run(load_export, name, str(tmp_path / "export.pt"))):
        _assert_bitwise(saved["params"], got["params"], f"rank {rank} params from the export")
        _assert_bitwise(saved["optim"], got["optim"], f"rank {rank} optimizer state from the export")
        assert got["groups"] == saved["groups"]


def resume_run(path: str, phase: str, config: dict, name: str = "gpt") -> list[float]:
    """Compiled model: "straight" trains 3 steps, saves, trains 3 more; "resumed" builds another
    model (other seed), loads the checkpoint and trains the same 3 steps."""
    torch.manual_seed((0 if phase == "straight" else 7) + dist.get_rank())  # each rank its own stream
    model = zpp_compile.shard(build(name), _config(**config))
    opt = _optimizer(model, lr=3e-3)
    compiled = torch.compile(model, backend="zeropp")
    if phase == "straight":
        _train(name, compiled, opt, range(3))
        zpp_compile.save_checkpoint(path, compiled, opt, extra={"step": 3})
    else:
        assert zpp_compile.load_checkpoint(path, compiled, opt) == {"step": 3}
    losses = _train(name, compiled, opt, range(3, 6))
    assert zpp_compile.compiled_graphs(), "the steps ran compiled"
    return losses


# Full ZeRO++ under mixed precision: the checkpoint holds the fp32 masters, and qwZ, hpZ's
# secondary shards and qgZ are rebuilt from them; with error feedback, its state is saved per rank.
ZERO_PP_BF16 = dict(
    param_dtype=torch.bfloat16, quantize_weights=True, hpz_size=2, quantize_gradients=True, ranks_per_node=2
)
RESUMED_RUNS = {
    "zero3": (2, {}, "gpt"),
    "zeropp_bf16": (4, ZERO_PP_BF16, "gpt"),
    "qgz_error_feedback": (4, dict(quantize_gradients=True, qgz_error_feedback=True, ranks_per_node=2), "gpt"),
    "dropout": (2, {}, "hf_gpt2_dropout"),  # the RNG states come back: the same masks
}


@pytest.mark.parametrize("case", RESUMED_RUNS)
def test_resuming_from_a_checkpoint_continues_the_loss_curve_exactly(pools, tmp_path, case):
    world, config, name = RESUMED_RUNS[case]
    path = str(tmp_path / "ckpt")
    straight = pools(world).run(resume_run, path, "straight", config, name)
    resumed = pools(world).run(resume_run, path, "resumed", config, name)
    assert resumed == straight  # bitwise: python floats of the float32 losses, every rank


def state_dict_forms(path: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    unsharded = build("gpt")
    torch.manual_seed(1)
    model = zpp_compile.shard(build("gpt"), _config())
    sd = model.state_dict()
    result = {
        "keys": list(sd) == list(unsharded.state_dict()),
        "shapes": all(sd[k].shape == v.shape for k, v in unsharded.state_dict().items()),
        "all_sharded": all(isinstance(v, DTensor) for v in sd.values()),
        "submodule_keys": list(model.blocks[1].attn.state_dict()) == list(unsharded.blocks[1].attn.state_dict()),
        "submodule_shape": model.blocks[1].attn.state_dict()["qkv.weight"].shape == (96, 32),
    }
    # This rank's rows of the weight, nothing more: rows [rank * 48, (rank + 1) * 48) of 96.
    qkv = sd["blocks.0.attn.qkv.weight"]
    full_qkv = zpp_compile.full_state_dict(model)["blocks.0.attn.qkv.weight"]
    result["slice"] = torch.equal(qkv.to_local(), full_qkv[rank * 96 // world : (rank + 1) * 96 // world])

    # A full, unsharded state dict (a pretrained export) loads into the sharded model.
    model.load_state_dict(unsharded.state_dict())
    full = zpp_compile.full_state_dict(model)
    result["full_load"] = all(torch.equal(full[k], v) for k, v in unsharded.state_dict().items())
    result["still_tied"] = model.lm_head._parameters["weight"] is model.wte._parameters["weight"]

    # The sharded form round-trips between two models of one layout, and training still works.
    other = zpp_compile.shard(build("gpt"), _config())
    missing = other.load_state_dict(model.state_dict())
    result["sharded_load"] = not missing.missing_keys and all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), other.parameters())
    )
    x, y = batch("gpt", LOCAL_BATCH * world, 0)
    loss_of("gpt", torch.compile(other, backend="zeropp"), x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    result["trains"] = all(p.grad is not None for p in other.parameters())

    # Plain DCP with the module itself as the Stateful entry: its state_dict() and load_state_dict().
    dcp.save({"model": model}, checkpoint_id=path)
    torch.manual_seed(2)
    third = zpp_compile.shard(build("gpt"), _config())
    dcp.load({"model": third}, checkpoint_id=path)
    result["plain_dcp"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), third.parameters())
    )

    # Errors name the key.
    bad = unsharded.state_dict()
    bad["blocks.1.fc.bias"] = torch.zeros(3)
    try:
        model.load_state_dict(bad)
        result["bad_shape"] = "no error"
    except RuntimeError as err:
        result["bad_shape"] = str(err)
    del bad["blocks.1.fc.bias"]
    try:
        model.load_state_dict(bad)
        result["missing"] = "no error"
    except RuntimeError as err:
        result["missing"] = str(err)
    return result


def test_state_dict_keeps_names_and_shapes_and_takes_a_full_state_dict(pools, tmp_path):
    for result in pools(2).run(state_dict_forms, str(tmp_path / "ckpt")):
        for check in ("keys", "shapes", "all_sharded", "submodule_keys", "submodule_shape", "slice"):
            assert result[check], check
        for check in ("full_load", "still_tied", "sharded_load", "trains", "plain_dcp"):
            assert result[check], check
        assert "size mismatch for blocks.1.fc.bias" in result["bad_shape"] and "[128]" in result["bad_shape"]
        assert 'Missing key(s) in state_dict: "blocks.1.fc.bias"' in result["missing"]


def frozen_int8_round_trip(path: str, phase: str) -> dict:
    config = _config(quantize_frozen_weights=True, weight_block_size=64)
    torch.manual_seed(0 if phase == "save" else 1)
    model = zpp_compile.shard(build("mlp"), config)
    if phase == "save":
        zpp_compile.save_checkpoint(path, model)
    else:
        zpp_compile.load_checkpoint(path, model)
    return {
        "payload": int8_payload(model.frozen, "weight").clone(),
        "full": zpp_compile.full_state_dict(model),
    }


def test_frozen_int8_stored_weights_round_trip(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools(2).run(frozen_int8_round_trip, path, "save")
    loaded = pools(2).run(frozen_int8_round_trip, path, "load")
    for before, after in zip(saved, loaded):
        assert before["payload"].dtype == torch.int8
        assert torch.equal(before["payload"], after["payload"])  # same world size: the same int8 payload
        _assert_bitwise(before["full"], after["full"], "params")
    # Stored as the dequantized weight, full shape, original dtype.
    md = FileSystemReader(path).read_metadata().state_dict_metadata["model.frozen.weight"]
    assert tuple(md.size) == (29, 29) and md.properties.dtype == torch.float32

    # At another world size the weight is re-quantized in other blocks: close, not bitwise.
    resharded = pools(4).run(frozen_int8_round_trip, path, "load")[0]["full"]["frozen.weight"]
    original = saved[0]["full"]["frozen.weight"]
    assert 0 < (resharded - original).abs().max() <= original.abs().max() / 254 * (1 + 1e-6)


class MLPWithExtra(OddMLP):
    def __init__(self) -> None:
        super().__init__()
        self.extra_scale = nn.Parameter(torch.tensor(2.0))  # not in the checkpoint


class WiderMLP(MLPWithExtra):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(29, 8)  # 7 in the checkpoint


def wrong_checkpoint(path: str) -> str:
    torch.manual_seed(0)
    model = zpp_compile.shard(OddMLP(), _config())
    zpp_compile.save_checkpoint(path, model)
    wider = zpp_compile.shard(WiderMLP(), _config())
    try:
        zpp_compile.load_checkpoint(path, wider)
    except zpp_compile.CheckpointMismatchError as err:
        message = str(err)
    else:
        message = "no error"
    try:
        zpp_compile.load_checkpoint(path, model, _optimizer(model))
    except zpp_compile.CheckpointMismatchError as err:
        message += "\n" + str(err)
    # Without strict, a model with one parameter more loads the rest and keeps that one.
    torch.manual_seed(1)
    bigger = zpp_compile.shard(MLPWithExtra(), _config())
    zpp_compile.load_checkpoint(path, bigger, strict=False)
    loaded = zpp_compile.full_state_dict(bigger)
    expected = zpp_compile.full_state_dict(model)
    same = all(torch.equal(loaded[k], v) for k, v in expected.items()) and loaded["extra_scale"].item() == 2.0
    return message + f"\nnon-strict load: {same}"


def test_a_checkpoint_that_does_not_fit_names_the_keys(pools, tmp_path):
    for message in pools(2).run(wrong_checkpoint, str(tmp_path / "ckpt")):
        assert "size mismatch for fc2.weight: the checkpoint has shape (7, 29), the model (8, 29)" in message
        assert "size mismatch for fc2.bias" in message
        assert "missing key(s) in the checkpoint: ['extra_scale']" in message
        assert "holds no optimizer state" in message
        assert "non-strict load: True" in message


V0_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_v0_gpt_world2"


def load_v0_checkpoint() -> dict:
    """A checkpoint written by zpp_compile 0.1 (flat shards, FlatShardedTensor), loaded now."""
    torch.manual_seed(1)
    model = zpp_compile.shard(build("gpt"), _config())
    opt = _optimizer(model, lr=0.5, weight_decay=0.0)
    extra = zpp_compile.load_checkpoint(str(V0_CHECKPOINT), model, opt)
    return _report(model, opt) | {"extra": extra}


@pytest.mark.parametrize("world", [2, 4])
def test_a_checkpoint_of_the_flat_shard_format_still_loads_bitwise(pools, world):
    expected = torch.load(V0_CHECKPOINT.parent / "checkpoint_v0_gpt_world2_expected.pt", weights_only=False)
    for rank, got in enumerate(pools(world).run(load_v0_checkpoint)):
        _assert_bitwise(expected["params"], got["params"], f"rank {rank} params")
        _assert_bitwise(expected["optim"], got["optim"], f"rank {rank} optimizer state")
        assert got["groups"] == expected["groups"] and got["extra"] == {"step": 2}


class _CrashOnPickle:
    """An `extra` value whose pickling raises: the save dies while its files are being written."""

    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of writing a checkpoint")


def save_then_crash_overwriting(path: str) -> dict:
    """Save step 2 to `path`, train 2 more steps, then die while overwriting `path`."""
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"), _config())
    opt = _optimizer(model)
    _train("mlp", model, opt, range(2))
    zpp_compile.save_checkpoint(path, model, opt, extra={"step": 2})
    saved = _report(model, opt)
    _train("mlp", model, opt, range(2, 4))
    try:
        zpp_compile.save_checkpoint(path, model, opt, extra={"step": 4, "crash": _CrashOnPickle()})
    except CheckpointException as err:  # raised by DCP on every rank (a BaseException)
        crashed = "simulated crash" in str(err)
    else:
        crashed = False
    try:  # the folder above a checkpoint is not a checkpoint folder: a save must not replace it
        zpp_compile.save_checkpoint(str(Path(path).parent), model, opt)
        refusal = "no error"
    except FileExistsError as err:
        refusal = str(err)
    return saved | {"crashed": crashed, "refusal": refusal}


def load_mlp(path: str) -> dict:
    torch.manual_seed(1)
    model = zpp_compile.shard(build("mlp"), _config())
    opt = _optimizer(model, lr=0.5, weight_decay=0.0)
    extra = zpp_compile.load_checkpoint(path, model, opt)
    return _report(model, opt) | {"extra": extra}


def test_a_save_that_dies_part_way_leaves_the_previous_checkpoint_intact(pools, tmp_path):
    # Saves are atomic: written into a temporary sibling folder, swapped in once complete.
    # Before, the crash left the old .metadata beside truncated data files (EOFError on load).
    path = str(tmp_path / "step_2")
    saved = pools(2).run(save_then_crash_overwriting, path)[0]
    assert saved["crashed"]
    for rank, got in enumerate(pools(2).run(load_mlp, path)):
        _assert_bitwise(saved["params"], got["params"], f"rank {rank} params")
        _assert_bitwise(saved["optim"], got["optim"], f"rank {rank} optimizer state")
        assert got["extra"] == {"step": 2}
    marker = json.loads((tmp_path / "step_2" / zpp_compile.checkpoint.MARKER_NAME).read_text())
    assert marker["world_size"] == 2 and marker["optimizer"] == "torch.optim.adamw.AdamW"
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith("step_2.partial-")]  # what the crash left
    assert "besides checkpoint files" in saved["refusal"] and "step_2" in saved["refusal"]


def load_error(path: str, verify: Optional[bool] = None) -> str:
    torch.manual_seed(1)
    model = zpp_compile.shard(build("mlp"), _config())
    return _error_of(lambda: zpp_compile.load_checkpoint(path, model, _optimizer(model), verify=verify))


def _error_of(load: Callable[[], object]) -> str:
    """The message of the CheckpointMismatchError that load() raises, or "no error"."""
    try:
        load()
    except zpp_compile.CheckpointMismatchError as err:
        return str(err)
    return "no error"


def test_latest_checkpoint_skips_newer_incomplete_folders_with_a_warning(pools, tmp_path):
    step_2 = tmp_path / "step_2"
    pools(2).run(train_and_save, "mlp", str(step_2), 2)
    # What a killed in-place save over step_4 left (zpp_compile 0.1): the previous .metadata
    # beside half-rewritten data files.
    step_4 = tmp_path / "step_4"
    step_4.mkdir()
    shutil.copy(step_2 / ".metadata", step_4)
    for data in step_2.glob("*.distcp"):
        (step_4 / data.name).write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    # What a save of step 6 killed before its completion marker leaves: its temporary folder.
    partial = tmp_path / "step_6.partial-0123abcd"
    shutil.copytree(step_2, partial)
    (partial / zpp_compile.checkpoint.MARKER_NAME).unlink()
    (tmp_path / "step_notes").mkdir()  # not <prefix><N>: ignored

    with pytest.warns(UserWarning) as caught:
        assert zpp_compile.latest_checkpoint(tmp_path) == step_2
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "step_6.partial-0123abcd" in messages[0] and "did not finish" in messages[0]
    assert "step_4'" in messages[1] and "__0_0.distcp has" in messages[1]
    assert zpp_compile.latest_checkpoint(tmp_path / "nothing_here") is None

    for message in pools(2).run(load_error, str(step_4)):
        assert f"checkpoint {str(step_4)!r} is incomplete" in message, message
    # A folder written by zpp_compile 0.1 has no marker and still loads (legacy-complete):
    # test_a_checkpoint_of_the_flat_shard_format_still_loads_bitwise.


def save_with_and_without_checksums(with_checksums: str, without: str) -> dict:
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"), _config())
    opt = _optimizer(model)
    _train("mlp", model, opt, range(2))
    zpp_compile.save_checkpoint(with_checksums, model, opt, checksums=True)
    zpp_compile.save_checkpoint(without, model, opt)
    return zpp_compile.full_state_dict(model)


def load_mlp_params(path: str) -> dict:
    return load_mlp(path)["params"]


def _flip_bytes_of_a_weight(folder: Path, data_file: str) -> None:
    """Corrupt the middle of the largest model tensor stored in `data_file` (a bit rot DCP cannot see)."""
    storage = FileSystemReader(folder).read_metadata().storage_data
    length, offset = max(
        (info.length, info.offset)
        for index, info in storage.items()
        if info.relative_path == data_file and index.fqn.startswith("model.")
    )
    raw = bytearray((folder / data_file).read_bytes())
    for at in range(offset + length // 2, offset + length // 2 + 8):
        raw[at] ^= 0xFF
    (folder / data_file).write_bytes(bytes(raw))


def test_checksums_name_a_corrupted_data_file_on_every_rank(pools, tmp_path):
    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    saved = pools(2).run(save_with_and_without_checksums, str(checked), str(unchecked))[0]
    marker = json.loads((checked / zpp_compile.checkpoint.MARKER_NAME).read_text())
    assert sorted(marker["checksums"]) == ["__0_0.distcp", "__1_0.distcp"]
    for folder in (checked, unchecked):
        _flip_bytes_of_a_weight(folder, "__1_0.distcp")

    # Rank 1 hashes __1_0.distcp (file 1 % 2); rank 0 learns it from rank 1 and raises the same.
    for message in pools(2).run(load_error, str(checked)):
        assert "is corrupted" in message and "__1_0.distcp: sha256" in message, message
        assert "__0_0.distcp" not in message
    # Without checksums the same corruption loads without an error, as wrong weights.
    loaded = pools(2).run(load_mlp_params, str(unchecked))[0]
    assert any(not torch.equal(saved[k], loaded[k]) for k in saved)
    for message in pools(2).run(load_error, str(unchecked), True):
        assert "holds no checksums" in message, message


class DropoutMLP(nn.Module):
    """Draws random numbers in forward (dropout), differently on each rank."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def dropout_resume_run(path: str, phase: str) -> dict:
    """Eager sharded DropoutMLP (the MLP's batches and loss): "straight" trains 3 steps, saves and
    trains 3 more; "resumed" loads into a model with other RNG states and trains the same 3."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = zpp_compile.shard(DropoutMLP(), _config())
    opt = _optimizer(model)
    torch.manual_seed(100 + dist.get_rank() if phase == "straight" else 7)  # per-rank dropout streams
    if phase == "straight":
        _train("mlp", model, opt, range(3))
        zpp_compile.save_checkpoint(path, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if phase != "straight":
            zpp_compile.load_checkpoint(path, model, opt)
    rng = torch.get_rng_state()
    losses = _train("mlp", model, opt, range(3, 6))
    return {"losses": losses, "rng": rng, "warnings": [str(w.message) for w in caught]}


def test_rng_states_resume_dropout_exactly_at_the_same_world_size(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = pools(2).run(dropout_resume_run, path, "straight")
    resumed = pools(2).run(dropout_resume_run, path, "resumed")
    assert not torch.equal(straight[0]["rng"], straight[1]["rng"])  # each rank restores its own stream
    for rank in range(2):
        assert torch.equal(resumed[rank]["rng"], straight[rank]["rng"])
        assert resumed[rank]["losses"] == straight[rank]["losses"]  # bitwise
        assert resumed[rank]["warnings"] == []
    # At another world size the streams cannot be resharded: one warning, the rest loads.
    for got in pools(4).run(dropout_resume_run, path, "resumed_at_world_4"):
        assert len(got["warnings"]) == 1 and "RNG states not restored" in got["warnings"][0]
        assert "saved at world size 2, and this is 4" in got["warnings"][0]


def load_into_another_optimizer(path: str, name: str, save_first: bool) -> dict[str, str]:
    """The errors of loading AdamW state into an Adam and an SGD optimizer: from a checkpoint (saved
    here first, or one of 0.1) and with load_optimizer_state_dict."""
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name), _config())
    adamw = _optimizer(model)
    _train(name, model, adamw, range(1))
    if save_first:
        zpp_compile.save_checkpoint(path, model, adamw)
    params = [p for p in model.parameters() if p.requires_grad]
    adam, sgd = torch.optim.Adam(params), torch.optim.SGD(params, lr=0.1)
    state_dict = zpp_compile.optimizer_state_dict(model, adamw)
    return {
        "checkpoint into Adam": _error_of(lambda: zpp_compile.load_checkpoint(path, model, adam)),
        "checkpoint into SGD": _error_of(lambda: zpp_compile.load_checkpoint(path, model, sgd)),
        "state dict into SGD": _error_of(lambda: zpp_compile.load_optimizer_state_dict(model, sgd, state_dict)),
    }


def test_optimizer_state_of_another_optimizer_class_is_refused(pools, tmp_path):
    got = pools(2).run(load_into_another_optimizer, str(tmp_path / "ckpt"), "mlp", True)[0]
    # Adam has AdamW's hyper-parameter keys: only the class the checkpoint records tells them apart.
    assert (
        "holds the state of a torch.optim.adamw.AdamW optimizer, not of a torch.optim.adam.Adam"
        in got["checkpoint into Adam"]
    ), got
    assert "AdamW optimizer, not of a torch.optim.sgd.SGD" in got["checkpoint into SGD"], got
    from_state_dict = got["state dict into SGD"]
    assert "param group 0 of the state dict has the hyper-parameters ['amsgrad', 'betas'," in from_state_dict, got
    assert "the SGD optimizer's have ['dampening', 'differentiable'" in from_state_dict, got
    # A checkpoint of zpp_compile 0.1 records no class: its hyper-parameter keys tell.
    legacy = pools(2).run(load_into_another_optimizer, str(V0_CHECKPOINT), "gpt", False)[0]["checkpoint into SGD"]
    assert f"param group 0 of checkpoint {str(V0_CHECKPOINT)!r}" in legacy and "'betas'" in legacy, legacy
    assert "only in the optimizer: ['dampening', 'momentum', 'nesterov']" in legacy, legacy


# --------------------------------------------------------------------------------------------
# torch.save of state_dict() in the user's own loop: each rank's file holds that rank's chunks


def torch_save_round_trip(folder: str, phase: str, pattern: str) -> dict:
    """`save`: train HF GPT-2 one step, then torch.save the model's and optimizer's state dicts,
    on every rank into its own file (`per_rank`) or on rank 0 alone (`rank0`, nanoGPT's pattern).
    `load`: every rank reads its own file (or rank 0's) into a fresh sharded model and optimizer,
    and steps once more."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0 if phase == "save" else 1)
    model = zpp_compile.shard(build("hf_gpt2"), _config())
    opt = _optimizer(model)
    file = Path(folder) / (f"rank{rank % 2}.pt" if pattern == "per_rank" else "rank0.pt")
    if phase == "save":
        _train("hf_gpt2", model, opt, range(1))
        if pattern == "per_rank" or rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, file)
        dist.barrier()
        return {"full": zpp_compile.full_state_dict(model), "optim": _full_optimizer_state(opt)}
    saved = torch.load(file, weights_only=False)
    result: dict = {}
    try:
        model.load_state_dict(saved["model"])
        result["model"] = "loaded"
    except zpp_compile.CheckpointMismatchError as err:
        result["model"] = str(err)
    opt.load_state_dict(saved["optim"])  # torch keeps the loaded tensors: checked at the next step
    if pattern == "per_rank" and world == 2:  # no step yet: the state as loaded
        result["full"] = zpp_compile.full_state_dict(model)
        result["optim"] = _full_optimizer_state(opt)
    try:
        # A step of the model only where every rank loaded it (elsewhere rank 0 would wait in a gather).
        _train("hf_gpt2", model, opt, range(1, 2)) if pattern == "per_rank" and world == 2 else opt.step()
        result["optim_step"] = "stepped"
    except zpp_compile.CheckpointMismatchError as err:
        result["optim_step"] = str(err)
    return result


def test_torch_save_of_each_ranks_state_dict_loads_back_bitwise_on_that_rank(pools, tmp_path):
    saved = pools(2).run(torch_save_round_trip, str(tmp_path), "save", "per_rank")[0]
    for result in pools(2).run(torch_save_round_trip, str(tmp_path), "load", "per_rank"):
        assert result["model"] == "loaded" and result["optim_step"] == "stepped", result
        assert all(torch.equal(result["full"][k], v) for k, v in saved["full"].items())
        for fqn, state in saved["optim"].items():
            assert all(torch.equal(result["optim"][fqn][key], v) for key, v in state.items()), fqn


def test_a_state_dict_torch_saved_on_rank_0_alone_is_refused_on_the_other_ranks(pools, tmp_path):
    pools(2).run(torch_save_round_trip, str(tmp_path), "save", "rank0")
    own, other = pools(2).run(torch_save_round_trip, str(tmp_path), "load", "rank0")
    assert own == {"model": "loaded", "optim_step": "stepped"}  # rank 0 reads its own chunks
    assert (
        "transformer.wte.weight holds the chunk of rank 0 of the job that saved it, loaded on rank 1" in other["model"]
    )
    assert "zpp_compile.save_checkpoint(path, model, optimizer)" in other["model"]
    assert "optimizer state transformer.wte.weight.exp_avg holds the chunk of rank 0" in other["optim_step"]


def replicated_entries_of_rank0s_file(folder: str) -> dict:
    """OddMLP's root holds `scale`, a 0-d parameter every rank holds whole: rank 0's copy is
    every rank's, so it loads anywhere; the refusal names the first sharded entry instead."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = zpp_compile.shard(build("mlp"), _config())
    opt = _optimizer(model)
    _train("mlp", model, opt, range(1))
    copy.deepcopy(opt)  # the load hook registered on it by the first step copies along
    file = Path(folder) / "rank0.pt"
    if rank == 0:
        torch.save(model.state_dict(), file)
    dist.barrier()
    saved = torch.load(file, weights_only=False)
    torch.manual_seed(1)
    other = zpp_compile.shard(build("mlp"), _config())
    other.load_state_dict({"scale": saved["scale"]}, strict=False)
    result = {"scale": torch.equal(other.scale.to_local(), model.scale.to_local())}
    try:
        other.load_state_dict(saved)
        result["all"] = "loaded"
    except zpp_compile.CheckpointMismatchError as err:
        result["all"] = str(err)
    return result


def test_replicated_entries_of_a_file_saved_on_rank_0_load_on_every_rank(pools, tmp_path):
    own, other = pools(2).run(replicated_entries_of_rank0s_file, str(tmp_path))
    assert own == {"scale": True, "all": "loaded"}
    assert other["scale"], other
    assert other["all"].startswith("fc1.weight holds the chunk of rank 0"), other


def test_per_rank_state_dict_files_loaded_at_another_world_size_are_refused(pools, tmp_path):
    pools(2).run(torch_save_round_trip, str(tmp_path), "save", "per_rank")
    for result in pools(4).run(torch_save_round_trip, str(tmp_path), "load", "per_rank"):
        assert "is a chunk saved at world size 2, loaded at world size 4" in result["model"], result
        assert "is a chunk saved at world size 2, loaded at world size 4" in result["optim_step"], result


def accelerate_save_and_load_state(folder: str) -> str:
    """Accelerate's save_state writes the optimizer's state_dict() from the main process alone."""
    from accelerate import Accelerator

    from .models import torchrun_environment

    with torchrun_environment():
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = zpp_compile.shard(build("hf_gpt2"), _config())
        opt = accelerator.prepare(_optimizer(model))
        _train("hf_gpt2", model, opt, range(1))
        accelerator.save_state(folder)
        dist.barrier()
        accelerator.load_state(folder)
        try:
            opt.step()
            return "stepped"
        except zpp_compile.CheckpointMismatchError as err:
            return str(err)


def test_accelerate_save_state_of_a_sharded_optimizer_is_refused_on_resume(pools, tmp_path):
    own, other = pools(2).run(accelerate_save_and_load_state, str(tmp_path / "state"))
    assert own == "stepped"
    assert "optimizer state transformer.wte.weight.exp_avg holds the chunk of rank 0" in other
