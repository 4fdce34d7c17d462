"""Config.keep_whole_numel: small parameters every rank holds whole (DTensor Replicate), their
gradients all-reduced in one bucket; and the threshold Config(plan="auto") chooses for it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile.auto_plan import choose_keep_whole_numel, kept_whole_names
from zpp_compile.cost_model import CostModel
from zpp_compile.layout import ShardedState, ShardSpec, shard_spec
from zpp_compile.topology import Topology

from .models import batch, build, gradient_errors, loss_of, lowering_of, sharded_with_reference
from .test_checkpoint import _assert_bitwise, _config, _optimizer, _report, _train
from .test_training import LOCAL_BATCH, RTOL
from .workers import reset_process_state

THRESHOLD = 1000  # the tiny models' biases and norms (<= 128 elements), none of their weights


def _kept(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if shard_spec(p).kept_whole}


def _replicas_agree(model: torch.nn.Module) -> bool:
    """Every rank's copy of every kept-whole parameter is bitwise rank 0's."""
    for name in sorted(_kept(model)):
        local = dict(model.named_parameters())[name].to_local().detach()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, local)
        if not all(torch.equal(c, copies[0]) for c in copies):
            return False
    return True


def train_kept_whole(name: str, mode: str, threshold: int, steps: int = 2, **config) -> dict:
    """`steps` AdamW steps of the model sharded with Config(keep_whole_numel=threshold) against its
    unsharded copy: gradient errors, clipped norms, collectives issued and whether replicas agree."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = zpp_compile.Config(lowering=lowering_of(mode), keep_whole_numel=threshold, **config)
    model, run, opt, reference, ref_opt = sharded_with_reference(name, mode, config)
    counter = zpp_compile.comm_counter()
    errors, norms, all_reduces, gathered = {}, [], [], []
    for step in range(steps):
        counter.reset()
        x, y = batch(name, LOCAL_BATCH * world, step)
        loss_of(name, run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        all_reduces.append(counter.calls(phase="backward", op="all_reduce"))
        gathered.append(counter.bytes(phase="forward", op="all_gather"))
        loss_of(name, reference, x, y).backward()
        errors.update(gradient_errors(model, reference, step))
        # clip_grad_norm_ over Shard(0) and Replicate gradients: the norm of the whole model's.
        norms.append(
            (
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor().item(),
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item(),
            )
        )
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    result = {
        "errors": errors,
        "norms": norms,
        "all_reduces": all_reduces,
        "gathered": gathered,
        "kept": _kept(model),
        "agree": _replicas_agree(model),
        "specs": {n: shard_spec(p) for n, p in model.named_parameters()},
    }
    reset_process_state()
    return result


def _check_against_reference(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= RTOL, f"rank {rank}: {worst} differs by {r['errors'][worst]:.2e}"
        for ours, reference in r["norms"]:
            assert ours == pytest.approx(reference, rel=1e-5)
        assert r["agree"], f"rank {rank}: the copies of a kept-whole parameter differ between ranks"


@pytest.mark.parametrize(
    "name, mode", [("gpt", "eager"), ("gpt", "inductor"), ("hf_llama", "eager"), ("hf_llama", "inductor"),
                   ("hf_gpt2_dropout", "inductor")],
)  # fmt: skip
def test_kept_whole_parameters_train_like_the_unsharded_model(pools, name, mode):
    results = pools(4).run(functools.partial(train_kept_whole, name, mode, THRESHOLD))
    kept = results[0]["kept"]
    assert kept and all(p.numel <= THRESHOLD for n, p in results[0]["specs"].items() if n in kept)
    assert all(p.numel > THRESHOLD for n, p in results[0]["specs"].items() if n not in kept and p.shape)
    if name != "hf_gpt2_dropout":  # dropout: the reference draws its own masks; gradients differ
        _check_against_reference(results)
    else:
        assert all(r["agree"] for r in results)


def kept_whole_against_sharded(name: str) -> dict:
    return {t: train_kept_whole(name, "inductor", t, steps=1) for t in (0, THRESHOLD)}


def test_kept_whole_parameters_are_never_gathered_and_share_one_all_reduce(pools):
    world = 4
    for r in pools(world).run(kept_whole_against_sharded, "hf_llama"):
        sharded, whole = r[0], r[THRESHOLD]
        assert sharded["all_reduces"] == [0]
        assert whole["all_reduces"] == [1], "the kept-whole gradients should travel in one all-reduce"
        # Forward gathers lose exactly the kept parameters' shards (as sent to each peer).
        saved = sum(s.shard_numel * 4 * (world - 1) for n, s in sharded["specs"].items() if n in whole["kept"])
        assert sharded["gathered"][0] - whole["gathered"][0] == saved


def save_kept_whole(path: str, threshold: int) -> dict:
    torch.manual_seed(0)
    model = zpp_compile.shard(build("gpt"), _config(keep_whole_numel=threshold))
    opt = _optimizer(model)
    _train("gpt", model, opt, range(2))
    zpp_compile.save_checkpoint(path, model, opt)
    report = _report(model, opt)
    reset_process_state()
    return report


def load_kept_whole(path: str, threshold: int) -> dict:
    torch.manual_seed(1)
    model = zpp_compile.shard(build("gpt"), _config(keep_whole_numel=threshold))
    opt = _optimizer(model, lr=0.5)
    zpp_compile.load_checkpoint(path, model, opt)
    report = _report(model, opt)
    reset_process_state()
    return report


@pytest.mark.parametrize("save, load", [(THRESHOLD, 0), (0, THRESHOLD)], ids=["whole_to_sharded", "sharded_to_whole"])
def test_a_checkpoint_moves_between_kept_whole_and_sharded_layouts_bitwise(pools, tmp_path, save, load):
    path = str(tmp_path / "ckpt")
    saved = pools(4).run(save_kept_whole, path, save)[0]
    for rank, got in enumerate(pools(2).run(load_kept_whole, path, load)):
        _assert_bitwise(saved["params"], got["params"], f"rank {rank} params")
        _assert_bitwise(saved["optim"], got["optim"], f"rank {rank} optimizer state")


# ---- The threshold Config(plan="auto") chooses (no processes: a ShardedState built by hand).

TWO_NODES = Topology(world_size=4, rank=0, ranks_per_node=2, world_group_name="world")


def _spec(fqn: str, *shape: int) -> ShardSpec:
    numel = int(torch.Size(shape).numel())
    return ShardSpec(fqn=fqn, shape=shape, numel=numel, group_size=4, group_name="world")


SPECS = [
    _spec("ln.weight", 64),
    _spec("fc.bias", 256),
    _spec("fc.weight", 256, 64),
    _spec("scale"),
    _spec("none", 0, 8),
]


def _state(inter_gbps: float, latency_us: float, budget: int = 2**30, specs: list = SPECS) -> ShardedState:
    cost = CostModel(10e9 / 8, inter_gbps * 1e9 / 8, 1e12, latency_s=latency_us / 1e6)
    state = ShardedState(zpp_compile.Config(plan="auto"), TWO_NODES, {s.fqn: s for s in specs}, cost_model=cost)
    state.memory_budget_bytes = budget
    return state


def test_the_plan_keeps_whole_what_its_link_moves_within_one_collectives_fixed_cost():
    # 1 Gbit/s between nodes moves 125 bytes per microsecond: an all-reduce of a 256-element fp32
    # bias sends 2 * 1024 * 3/4 = 1536 bytes, 12.3 us; of the 64-element norm, 3.1 us.
    assert choose_keep_whole_numel(_state(1.0, latency_us=50)) == 256
    assert choose_keep_whole_numel(_state(1.0, latency_us=5)) == 64
    assert choose_keep_whole_numel(_state(1.0, latency_us=1)) == 0
    # The 0-d parameter is replicated anyway, and is never what sets the threshold; an empty one
    # stays sharded (as every parameter with a dim does under the default threshold, 0).
    assert kept_whole_names(SPECS, 256) == {"ln.weight", "fc.bias"}
    assert kept_whole_names(SPECS, 0) == set()


def test_the_plan_prices_the_all_reduce_in_the_reduce_dtype():
    # In bf16 the 256-element bias sends half the bytes: 6.1 us, under a 10 us fixed cost.
    assert choose_keep_whole_numel(_state(1.0, latency_us=10)) == 64
    bf16 = [dataclasses.replace(s, compute_dtype=torch.bfloat16) for s in SPECS]
    assert choose_keep_whole_numel(_state(1.0, latency_us=10, specs=bf16)) == 256


def test_the_plan_keeps_nothing_whole_that_the_budget_cannot_hold():
    state = _state(1.0, latency_us=50, budget=2**30)
    floor = zpp_compile.auto_plan.zero3_floor_bytes(state)
    # Kept whole, the norm adds 3/4 of its 256 bytes and of its gradient's: 384 bytes, which needs
    # 768 bytes of headroom above the floor (half the headroom is the plan's).
    assert choose_keep_whole_numel(_state(1.0, latency_us=50, budget=floor + 768)) == 64
    assert choose_keep_whole_numel(_state(1.0, latency_us=50, budget=floor + 767)) == 0


def test_config_checks_keep_whole_numel():
    with pytest.raises(ValueError, match="keep_whole_numel"):
        zpp_compile.Config(keep_whole_numel=-1)
    with pytest.raises(ValueError, match="chooses keep_whole_numel itself"):
        zpp_compile.Config(plan="auto", keep_whole_numel=100)
