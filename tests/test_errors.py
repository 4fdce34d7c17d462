"""Every bad input gets an error that names the problem and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zpp_compile

from .models import OddMLP


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"weight_block_size": 4}, ValueError, "weight_block_size=4 is out of range"),
        ({"weight_block_size": 100}, ValueError, "multiple of 8"),
        ({"hpz_size": 0}, ValueError, "hpz_size=0 is out of range"),
        ({"ranks_per_node": -2}, ValueError, "ranks_per_node=-2 is out of range"),
        ({"ranks_per_node": 2.0}, TypeError, "ranks_per_node must be an int"),
        ({"quantize_weights": "yes"}, TypeError, "quantize_weights must be True or False"),
        ({"quantize_frozen_weights": 1}, TypeError, "quantize_frozen_weights must be True or False"),
        ({"qgz_error_feedback": True}, ValueError, "qgz_error_feedback=True needs quantize_gradients=True"),
        ({"gradient_block_size": 100}, ValueError, "gradient_block_size=100 must be a multiple of 8"),
        ({"lowering": "tvm"}, ValueError, "use 'inductor' or 'aot_eager'"),
        ({"param_dtype": torch.int8}, ValueError, "param_dtype=torch.int8 is not a floating-point torch dtype"),
        ({"reduce_dtype": "bf16"}, ValueError, "use torch.bfloat16"),
        ({"weight_block_size": 2**26}, ValueError, "weight_block_size=67108864 is larger than 8192.*1.6 GB"),
        ({"gradient_block_size": 2**14}, ValueError, "gradient_block_size=16384 is larger than 8192"),
        ({"collective_timeout_s": float("nan")}, ValueError, "collective_timeout_s=nan must be a positive number"),
        ({"check_schedule": -1}, ValueError, "check_schedule=-1 is out of range"),
        ({"qgz_error_beta": 0.5}, ValueError, r"qgz_error_beta=0.5 is a setting of error feedback"),
        ({"qgz_error_beta": 1.0}, ValueError, r"qgz_error_beta=1.0 must be a number in \[0, 1\)"),
        ({"qgz_error_beta": "0.8"}, ValueError, r"qgz_error_beta='0.8' must be a number in \[0, 1\)"),
    ],
)
def test_config_values_out_of_range(kwargs, error, message):
    with pytest.raises(error, match=message):
        zpp_compile.Config(**kwargs)


def test_config_is_frozen():
    with pytest.raises(Exception, match="cannot assign"):
        zpp_compile.Config().hpz_size = 2


def _run_without_process_group(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout
    return result.stderr


def test_shard_without_process_group():
    stderr = _run_without_process_group(
        """
        import torch, zpp_compile
        zpp_compile.shard(torch.nn.Linear(2, 2))
        """
    )
    assert "DistributedNotInitializedError" in stderr and "init_process_group()" in stderr


def test_compile_without_process_group():
    stderr = _run_without_process_group(
        """
        import torch
        torch.compile(torch.nn.Linear(2, 2), backend="zeropp")(torch.randn(1, 2))
        """
    )
    assert "torch.compile(backend='zeropp') needs torch.distributed" in stderr


def compile_unsharded() -> None:
    torch.compile(OddMLP(), backend="zeropp")(torch.randn(2, 13))


def shard_twice() -> None:
    model = zpp_compile.shard(OddMLP())
    zpp_compile.shard(model)


def shard_submodule_then_root() -> None:
    model = OddMLP()
    zpp_compile.shard(model.fc1)
    zpp_compile.shard(model)


def misfit_ranks_per_node() -> None:
    zpp_compile.shard(OddMLP(), zpp_compile.Config(ranks_per_node=3))


def shard_under_launcher_env(per_rank_env: list[dict[str, str]]) -> None:
    """shard() with this rank's LOCAL_WORLD_SIZE / GROUP_RANK set as a (faulty) launcher would."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK")}
    os.environ.update(per_rank_env[torch.distributed.get_rank()])
    try:
        zpp_compile.shard(OddMLP())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Rank 1 claims node 0 although rank // LOCAL_WORLD_SIZE puts it on node 1.
RANKS_NOT_NODE_BY_NODE = [{"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}] * 2
# The two ranks disagree on how many ranks a node holds.
UNEVEN_NODES = [{"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}]


def replace_a_parameter_after_shard(compiled: bool) -> None:
    model = zpp_compile.shard(OddMLP(), zpp_compile.Config(lowering="aot_eager"))
    model.fc1.weight = torch.nn.Parameter(torch.randn(29, 13))
    (torch.compile(model, backend="zeropp") if compiled else model)(torch.randn(2, 13))


def add_a_parameter_after_shard() -> None:
    model = zpp_compile.shard(OddMLP())
    model.fc2.extra = torch.nn.Parameter(torch.ones(7))
    model(torch.randn(2, 13))


def resize_embeddings_after_shard() -> None:
    from .models import build  # noqa: PLC0415

    model = zpp_compile.shard(build("hf_gpt2"))
    model.resize_token_embeddings(64)  # the current size (scripts pass len(tokenizer) unconditionally): runs
    model.resize_token_embeddings(60, pad_to_multiple_of=32)  # rounded up to the current 64: runs
    model.resize_token_embeddings(pad_to_multiple_of=48)  # 96 rows


def move_the_model_after_shard(compiled: bool) -> None:
    model = zpp_compile.shard(OddMLP(), zpp_compile.Config(lowering="aot_eager"))
    model.to("meta")
    (torch.compile(model, backend="zeropp") if compiled else model)(torch.randn(2, 13, device="meta"))


def shard_a_model_already_in(wrapper: str) -> None:
    """A migration that keeps the old library's wrapping and adds shard()."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from .models import build  # noqa: PLC0415

    model = build("hf_gpt2")
    if wrapper == "fully_shard":
        for block in model.transformer.h:
            fully_shard(block)
        zpp_compile.shard(model)
    else:
        zpp_compile.shard(DistributedDataParallel(model))


REPLACED = "ShardingError: parameter 'fc1.weight' \\(Linear.weight\\) was replaced by a tensor that is not a shard"
MOVED_TO_META = (
    "parameter '\\w+(\\.\\w+)?' \\(\\w+\\.\\w+\\) was moved to meta after zpp_compile.shard\\(\\) placed it on cpu"
)


def hpz_size_not_dividing_the_node() -> None:
    zpp_compile.shard(OddMLP(), zpp_compile.Config(ranks_per_node=2, hpz_size=4))


@pytest.mark.parametrize(
    "world, task, args, message",
    [
        (1, compile_unsharded, (), "unsharded parameter .* call zpp_compile.shard"),
        (1, shard_twice, (), "shard\\(\\) was already called on this model"),
        (1, shard_submodule_then_root, (), "already a zpp_compile shard"),
        (4, misfit_ranks_per_node, (), "world size 4 is not a multiple of ranks_per_node=3"),
        (2, shard_under_launcher_env, (RANKS_NOT_NODE_BY_NODE,), "rank 1 runs on node 0 \\(GROUP_RANK\\)"),
        (2, shard_under_launcher_env, (UNEVEN_NODES,), "LOCAL_WORLD_SIZE differs between ranks"),
        (4, hpz_size_not_dividing_the_node, (), "hpz_size=4 must divide the ranks of a node \\(ranks_per_node=2\\)"),
        (2, replace_a_parameter_after_shard, (False,), REPLACED),
        (2, replace_a_parameter_after_shard, (True,), REPLACED),
        (2, add_a_parameter_after_shard, (), "parameter 'fc2.extra' .* was added after zpp_compile.shard"),
        (
            2,
            resize_embeddings_after_shard,
            (),
            "ShardingError: resize_token_embeddings to 96 rows .*\\(64 rows now\\).* Resize before sharding",
        ),
        (
            2,
            shard_a_model_already_in,
            ("fully_shard",),
            "ShardingError: module 'transformer.h.0' is already managed by fully_shard \\(FSDP2\\)",
        ),
        (
            2,
            shard_a_model_already_in,
            ("ddp",),
            "module '\\(the root\\)' is already managed by DistributedDataParallel",
        ),
        (2, move_the_model_after_shard, (False,), MOVED_TO_META),
        (2, move_the_model_after_shard, (True,), MOVED_TO_META),
    ],
)
def test_bad_use_is_refused_with_a_clear_message(pools, world, task, args, message):
    with pytest.raises(AssertionError, match=message):
        pools(world).run(task, *args)


def test_backend_resolves_by_name_without_importing_zpp_compile():
    code = "import torch; from torch._dynamo.backends.registry import lookup_backend; print(lookup_backend('zeropp').__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "zpp_compile.backend", out.stderr


def infinite_timeout_and_big_blocks() -> list[str]:
    """collective_timeout_s=inf means no timeout (it overflowed before); a block far larger than
    the shards warns with the cost."""
    import warnings

    zpp_compile.shard(OddMLP(), zpp_compile.Config(collective_timeout_s=float("inf")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zpp_compile.shard(OddMLP(), zpp_compile.Config(quantize_weights=True, weight_block_size=4096))
    return [str(w.message) for w in caught if "weight_block_size" in str(w.message)]


def test_an_infinite_timeout_is_accepted_and_oversized_blocks_warn(pools):
    for messages in pools(2).run(infinite_timeout_and_big_blocks):
        assert len(messages) == 1 and "pads this model's shards from" in messages[0], messages


def shard_a_model_that_differs_between_ranks(what: str) -> str:
    """shard() with another Config (or another parameter shape) on rank 1 than on rank 0."""
    import torch.distributed as dist

    config, hidden = zpp_compile.Config(), 29
    if dist.get_rank() == 1:
        if what == "config":
            config = zpp_compile.Config(gather_bucket_bytes=0)
        else:
            hidden = 30
    model = torch.nn.Sequential(torch.nn.Linear(13, hidden), torch.nn.Linear(hidden, 7))
    try:
        zpp_compile.shard(model, config)
    except zpp_compile.ShardingError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "what, difference",
    [
        ("config", "Config.gather_bucket_bytes is 26214400 on rank 0 but 0 on rank 1"),
        (
            "parameter",
            "parameter '0.weight' (shape (29, 13), float32) on rank 0 but '0.weight' (shape (30, 13), float32) on rank 1",
        ),
    ],
)
def test_ranks_sharding_different_configs_or_shapes_fail_together_naming_the_difference(pools, what, difference):
    # Before, gloo aborted one rank ("Received data size doesn't match") and the other saw a dead peer.
    messages = pools(2).run(shard_a_model_that_differs_between_ranks, what)
    assert messages[0] == messages[1], messages  # raised on every rank, the same message
    assert "ranks disagree on what they shard" in messages[0] and difference in messages[0], messages[0]
