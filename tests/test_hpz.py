"""hpZ: the backward re-gathers weights from secondary shards inside each (simulated) node."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.backend import compiled_graphs
from zpp_compile.codegen.quantize import payload_numel
from zpp_compile.passes.graph_utils import c10d

from .models import batch, build, loss_of, sharding_error
from .workers import reset_process_state

# Inductor's post-grad passes turn the recorded graph's views into reshapes, in place.
_UNPACKING = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.constant_pad_nd.default)


def _saved_input(node: torch.fx.Node):
    """The backward input an all-gather sends, through the flatten/pad that prepare a local chunk."""
    while node.op == "call_function" and node.target in _UNPACKING:
        node = node.args[0]
    return node if node.op == "placeholder" else None


def _backward_gathers_of_saved_shards(record) -> list[tuple[int, int, str, torch.dtype]]:
    """(numel saved, numel sent, group name, dtype) of every backward all-gather of a saved input."""
    found = []
    for n in record.backward.graph.nodes:
        saved = _saved_input(n.args[0]) if n.target == c10d.all_gather_into_tensor.default else None
        if saved is not None:
            sent = n.args[0].meta["val"]
            found.append((saved.meta["val"].numel(), sent.numel(), n.args[2], sent.dtype))
    return found


@contextlib.contextmanager
def _saved_storage_bytes():
    """{storage pointer: bytes} of every storage the forward saves for backward, as autograd sees it."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def _train(name: str, config: zpp_compile.Config, steps: int, micro_batches: int = 1) -> dict:
    # One gather per parameter: this file inspects the backward's gathers of saved shards one by one.
    config = dataclasses.replace(config, gather_bucket_bytes=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build(name)
    zpp_compile.shard(model, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    compiled = torch.compile(model, backend="zeropp")
    counter = zpp_compile.comm_counter()
    counter.reset()
    grads = []
    saved_bytes = []
    for step in range(steps):
        for micro in range(micro_batches):
            x, y = batch(name, 2 * world, step * micro_batches + micro)
            with _saved_storage_bytes() as storages:
                loss = loss_of(name, compiled, x.chunk(world)[rank], y.chunk(world)[rank])
            saved_bytes.append(sum(storages.values()))
            loss.backward()
        grads.append([p.grad.to_local().clone() for p in trainable])
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        eval_out = compiled.eval()(batch(name, 2 * world, 99)[0].chunk(world)[rank])
    result = {
        "grads": grads,
        "params": [p.to_local().detach().clone() for p in trainable],
        "eval": eval_out,
        "saved_storage_bytes": saved_bytes[-1],
        "bw_gather_inter": counter.bytes(phase="backward", op="all_gather", locality="inter"),
        "bw_gather_intra": counter.bytes(phase="backward", op="all_gather", locality="intra"),
        "saved_gathers": _backward_gathers_of_saved_shards(_training_graph()),
        "hpz_group": sharded_topology(model).hpz_group_name,
    }
    reset_process_state()
    return result


def _training_graph():
    return [r for r in compiled_graphs() if r.backward is not None][-1]


def sharded_topology(model):
    return zpp_compile.sharding.sharded_state(model).topology


def hpz_vs_plain(name: str, ranks_per_node: int, hpz_size: int, steps: int = 3, micro_batches: int = 1) -> dict:
    plain = _train(name, zpp_compile.Config(ranks_per_node=ranks_per_node), steps, micro_batches)
    hpz = _train(name, zpp_compile.Config(ranks_per_node=ranks_per_node, hpz_size=hpz_size), steps, micro_batches)
    return {"plain": plain, "hpz": hpz, "world": dist.get_world_size()}


def _check(result: dict, hpz_size: int) -> None:
    plain, hpz, world = result["plain"], result["hpz"], result["world"]
    for step, (a, b) in enumerate(zip(plain["grads"], hpz["grads"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: hpZ changed a gradient"
    assert all(torch.equal(x, y) for x, y in zip(plain["params"], hpz["params"]))
    assert torch.equal(plain["eval"], hpz["eval"])
    # The backward gathers stay inside the node; without hpZ they cross it.
    assert plain["bw_gather_inter"] > 0 and hpz["bw_gather_inter"] == 0
    assert hpz["bw_gather_intra"] > 0
    # The forward saved secondary shards only: 1/hpz_size of each re-gathered (padded) weight,
    # where plain ZeRO-3 saved the 1/world primary shard; and each is gathered over the hpZ group.
    assert len(hpz["saved_gathers"]) == len(plain["saved_gathers"]) > 0
    plain_sent = sum(sent for _, sent, _, _ in plain["saved_gathers"])
    assert sum(sent for _, sent, _, _ in hpz["saved_gathers"]) == plain_sent * world // hpz_size
    assert {g for _, _, g, _ in hpz["saved_gathers"]} == {hpz["hpz_group"]}
    # And the memory autograd really holds grows by exactly that: the secondary shards own their
    # storage (a view into the gathered weight would keep the whole weight alive).
    extra = sum(n * 4 for n, _, _, _ in hpz["saved_gathers"]) - sum(n * 4 for n, _, _, _ in plain["saved_gathers"])
    assert hpz["saved_storage_bytes"] - plain["saved_storage_bytes"] == extra


def int8_vs_full_precision_secondary(name: str, frozen_int8: bool, lowering: str) -> dict:
    """qwZ (or frozen int8 weights) + hpZ, the secondary shard kept int8 vs dequantized."""
    config = functools.partial(
        zpp_compile.Config, ranks_per_node=2, hpz_size=2, quantize_weights=not frozen_int8,
        quantize_frozen_weights=frozen_int8, weight_block_size=64, lowering=lowering,
    )  # fmt: skip
    full = _train(name, config(hpz_quantized_secondary=False), 3)
    int8 = _train(name, config(hpz_quantized_secondary=True), 3)
    return {"full": full, "int8": int8}


# The GPT (many parameter shapes, tied weights) runs as FX graphs: its Inductor compiles took 79 s;
# the MLP cases cover the Inductor lowering of the int8 secondary.
@pytest.mark.parametrize(
    "name,frozen_int8,lowering", [("mlp", False, "inductor"), ("gpt", False, "aot_eager"), ("mlp", True, "inductor")]
)
def test_int8_secondary_gives_the_same_gradients_for_a_quarter_of_the_bytes(pools, name, frozen_int8, lowering):
    for result in pools(4).run(int8_vs_full_precision_secondary, name, frozen_int8, lowering):
        full, int8 = result["full"], result["int8"]
        for step, (a, b) in enumerate(zip(full["grads"], int8["grads"])):
            # The backward dequantizes the very payloads the forward did: the same weights. Inductor
            # fuses that dequantize into the backward's kernels, which may reorder fp32 arithmetic:
            # measured 0 for the MLP; for the GPT up to 4e-7 at step 0, 1.2e-6 at step 2 once Adam
            # has carried those differences into the weights. A wrong slice gives errors of order 1.
            diffs = [((x - y).norm() / x.norm().clamp_min(1e-30)).item() for x, y in zip(a, b)]
            assert max(diffs) <= 1e-5, f"step {step}: int8 secondary changed a gradient: {diffs}"
        assert full["bw_gather_inter"] == int8["bw_gather_inter"] == 0
        assert int8["bw_gather_intra"] < full["bw_gather_intra"]
        # Each int8 secondary holds world/hpz = 2 whole payloads of the primary shard (int8 blocks of
        # 64, padded, + one fp32 scale each) where the dequantized one holds 2 primary shards.
        kinds = []
        for (_, n_full, _, dtype_full), (_, n_int8, _, dtype_int8) in zip(full["saved_gathers"], int8["saved_gathers"]):
            if dtype_int8 == torch.int8:
                assert n_int8 == 2 * payload_numel(n_full // 2, 64)
            else:
                assert (n_int8, dtype_int8) == (n_full, dtype_full)
            kinds.append(dtype_int8)
        assert (torch.int8 in kinds) and (frozen_int8 or set(kinds) == {torch.int8}), kinds
        weight_bytes = {
            label: sum(n * dtype.itemsize for n, _, _, dtype in r["saved_gathers"]) for label, r in result.items()
        }
        saved = {label: r["saved_storage_bytes"] for label, r in result.items()}
        assert saved["full"] - saved["int8"] == weight_bytes["full"] - weight_bytes["int8"] > 0


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hpz_two_nodes_of_two_gives_bitwise_equal_gradients(pools, name):
    for result in pools(4).run(hpz_vs_plain, name, 2, 2):
        _check(result, 2)


@pytest.mark.parametrize("name,micro_batches", [("ckpt_mlp", 1), ("mlp", 3)])
def test_hpz_with_activation_checkpointing_and_gradient_accumulation(pools, name, micro_batches):
    for result in pools(4).run(hpz_vs_plain, name, 2, 2, 2, micro_batches):
        _check(result, 2)


@pytest.mark.parametrize("hpz_size", [2, 4])
def test_hpz_two_nodes_of_four_gives_bitwise_equal_gradients(pools, hpz_size):
    for result in pools(8).run(hpz_vs_plain, "mlp", 4, hpz_size):
        _check(result, hpz_size)


# The GPT's last block: the weights its backward gathers first.
LAST_BLOCK = tuple(f"blocks.1.{n}" for n in ("attn.qkv.weight", "attn.proj.weight", "fc.weight", "fc_proj.weight"))


def hpz_for_some_weights() -> dict:
    config = zpp_compile.Config(ranks_per_node=2)
    plain = _train("gpt", config, 2)
    partial = _train("gpt", dataclasses.replace(config, hpz_size=2, hpz_parameters=LAST_BLOCK), 2)
    return {"plain": plain, "partial": partial, "world": dist.get_world_size()}


def test_hpz_parameters_gives_hpz_to_the_weights_it_names_only(pools):
    for result in pools(4).run(hpz_for_some_weights):
        plain, partial, world = result["plain"], result["partial"], result["world"]
        for step, (a, b) in enumerate(zip(plain["grads"], partial["grads"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: hpZ changed a gradient"
        # The named weights' backward gathers run in the node from secondary shards (1/2 of the
        # weight); every other weight's runs over the world from its primary shard, as without hpZ.
        in_node = [g for g in partial["saved_gathers"] if g[2] == partial["hpz_group"]]
        over_world = collections.Counter(g for g in partial["saved_gathers"] if g[2] != partial["hpz_group"])
        moved = collections.Counter(plain["saved_gathers"]) - over_world
        assert len(in_node) == moved.total() == len(LAST_BLOCK), partial["saved_gathers"]
        assert over_world.total() == len(plain["saved_gathers"]) - len(LAST_BLOCK) > 0
        assert sum(sent for _, sent, _, _ in in_node) == sum(sent for _, sent, _, _ in moved.elements()) * world // 2
        assert 0 < partial["bw_gather_inter"] < plain["bw_gather_inter"]


def int8_secondary_for_some_weights() -> dict:
    config = zpp_compile.Config(
        ranks_per_node=2, hpz_size=2, quantize_weights=True, qwz_parameters=LAST_BLOCK, weight_block_size=64,
        lowering="aot_eager",
    )  # fmt: skip
    full = _train("gpt", dataclasses.replace(config, hpz_quantized_secondary=False), 2)
    return {"full": full, "int8": _train("gpt", config, 2)}


def test_hpz_keeps_int8_secondaries_of_the_weights_qwz_parameters_names_only(pools):
    """qwZ for the last block only: its weights' secondary shards are the int8 payloads the forward
    gathered, the other weights' stay in full precision; the gradients are those of the secondary
    kept dequantized (the same weights; rounding bound as in the int8 test above)."""
    for result in pools(4).run(int8_secondary_for_some_weights):
        full, int8 = result["full"], result["int8"]
        for step, (a, b) in enumerate(zip(full["grads"], int8["grads"])):
            diffs = [((x - y).norm() / x.norm().clamp_min(1e-30)).item() for x, y in zip(a, b)]
            assert max(diffs) <= 1e-5, f"step {step}: int8 secondary changed a gradient: {diffs}"
        assert int8["bw_gather_inter"] == 0 < int8["bw_gather_intra"] < full["bw_gather_intra"]
        assert {dtype for _, _, _, dtype in full["saved_gathers"]} == {torch.float32}
        dtypes = collections.Counter(dtype for _, _, _, dtype in int8["saved_gathers"])
        assert dtypes == {torch.int8: len(LAST_BLOCK), torch.float32: len(full["saved_gathers"]) - len(LAST_BLOCK)}


def test_hpz_parameters_with_a_name_the_model_lacks_is_refused(pools):
    config = zpp_compile.Config(ranks_per_node=2, hpz_size=2, hpz_parameters=("blocks.1.attn.qkv.weight", "nope"))
    for message in pools(4).run(sharding_error, config):
        assert "Config.hpz_parameters names ['nope']" in message and "named_parameters()" in message


def test_hpz_parameters_needs_hpz_and_a_tuple_of_names():
    with pytest.raises(ValueError, match="set hpz_size too"):
        zpp_compile.Config(hpz_parameters=("fc.weight",))
    with pytest.raises(TypeError, match="tuple of parameter names"):
        zpp_compile.Config(hpz_size=2, hpz_parameters="fc.weight")


def forward_gathers_per_config() -> dict[str, int]:
    """All-gathers in the compiled forward of the GPT cut by block, under ZeRO-3 and under qwZ + hpZ."""
    counts = {}
    for label, extra in (("zero3", {}), ("qwz_hpz", {"quantize_weights": True, "hpz_size": 2})):
        torch.manual_seed(0)
        model = zpp_compile.shard(
            build("gpt"), zpp_compile.Config(ranks_per_node=2, inductor_regions=True, lowering="aot_eager", **extra)
        )
        x, y = batch("gpt", 2 * dist.get_world_size(), 0)
        loss_of("gpt", torch.compile(model, backend="zeropp"), x, y).backward()
        starts = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)
        counts[label] = sum(n.target in starts for n in _training_graph().forward.graph.nodes)
        reset_process_state()
    return counts


def test_qwz_and_hpz_gather_a_block_in_as_few_collectives_as_zero3(pools):
    """qwZ + hpZ change what each forward gather carries, not how the gathers are bucketed (one per
    block here). The gathers hpz inlined had lost their parameter, and each became a collective of
    its own: the forward's 4 gathers became 15 for this GPT."""
    for counts in pools(4).run(forward_gathers_per_config):
        assert counts["qwz_hpz"] == counts["zero3"], counts


def checkpointed_vs_not(lowering: str) -> dict:
    config = zpp_compile.Config(ranks_per_node=2, hpz_size=2, lowering=lowering)
    return {name: _train(name, config, steps=2) for name in ("ckpt_mlp", "mlp")}


@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_activation_checkpointing_under_hpz_matches_the_run_without_it(pools, lowering):
    """torch.utils.checkpoint around the whole model: the backward recomputes the forward, and the
    weights it needs are gathered again from the secondary shards, inside the node."""
    for result in pools(4).run(checkpointed_vs_not, lowering):
        checkpointed, plain = result["ckpt_mlp"], result["mlp"]
        for step, (a, b) in enumerate(zip(checkpointed["grads"], plain["grads"])):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=f"step {step}")
        assert checkpointed["bw_gather_inter"] == 0 and checkpointed["bw_gather_intra"] > 0
        assert {g for _, _, g, _ in checkpointed["saved_gathers"]} == {checkpointed["hpz_group"]}
