"""Sharded checkpoints: state dicts and torch.distributed.checkpoint, resharded across world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zpp_compile
from torch.distributed.tensor import DTensor

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


def resume_run(path: str, phase: str, config: dict) -> list[float]:
    """Compiled GPT: "straight" trains 3 steps, saves, trains 3 more; "resumed" builds another
    model (other seed), loads the checkpoint and trains the same 3 steps."""
    torch.manual_seed(0 if phase == "straight" else 7)
    model = zpp_compile.shard(build("gpt"), _config(**config))
    opt = _optimizer(model, lr=3e-3)
    compiled = torch.compile(model, backend="zeropp")
    if phase == "straight":
        _train("gpt", compiled, opt, range(3))
        zpp_compile.save_checkpoint(path, compiled, opt, extra={"step": 3})
    else:
        assert zpp_compile.load_checkpoint(path, compiled, opt) == {"step": 3}
    losses = _train("gpt", compiled, opt, range(3, 6))
    assert zpp_compile.compiled_graphs(), "the steps ran compiled"
    return losses


# Full ZeRO++ under mixed precision: the checkpoint holds the fp32 masters, and qwZ, hpZ's
# secondary shards and qgZ (without error feedback, whose state is not saved) are rebuilt from them.
ZERO_PP_BF16 = dict(
    param_dtype=torch.bfloat16, quantize_weights=True, hpz_size=2, quantize_gradients=True, ranks_per_node=2
)


@pytest.mark.parametrize("world, config", [(2, {}), (4, ZERO_PP_BF16)], ids=["zero3", "zeropp_bf16"])
def test_resuming_from_a_checkpoint_continues_the_loss_curve_exactly(pools, tmp_path, world, config):
    path = str(tmp_path / "ckpt")
    straight = pools(world).run(resume_run, path, "straight", config)
    resumed = pools(world).run(resume_run, path, "resumed", config)
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
    result["plain_dcp"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), third.parameters()))

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
