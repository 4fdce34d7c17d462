"""zpp_compile/eager_collectives.py: on gloo, large eager gathers and reduce-scatters run per owner
(broadcasts; reduces in pieces through a one-piece scratch) and give what the tensor collectives
give."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import zpp_compile
from zpp_compile import eager_collectives
from zpp_compile.compat import all_gather_single, reduce_scatter_single

from .models import batch, build, local_grad, loss_of

SLICE = 5


@contextlib.contextmanager
def rooted_from(min_bytes: int, piece_bytes: int = 8):
    """Every tensor of at least `min_bytes` takes the rooted forms, reduced in pieces of
    `piece_bytes` (8: two floats, so a slice of 5 goes as 2 + 2 + 1); this worker only, restored.
    Yields the list of each collective's choice (True: rooted)."""
    saved = eager_collectives.ROOTED_MIN_BYTES, eager_collectives.ROOTED_PIECE_BYTES, eager_collectives.uses_rooted_form
    choices: list[bool] = []

    def counted(whole, group):
        choices.append(saved[2](whole, group))
        return choices[-1]

    eager_collectives.ROOTED_MIN_BYTES, eager_collectives.ROOTED_PIECE_BYTES = min_bytes, piece_bytes
    eager_collectives.uses_rooted_form = counted
    try:
        yield choices
    finally:
        eager_collectives.ROOTED_MIN_BYTES, eager_collectives.ROOTED_PIECE_BYTES, eager_collectives.uses_rooted_form = (
            saved
        )


def flat_collectives() -> dict:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    shard = torch.arange(SLICE, dtype=torch.float32) + 1000 * rank
    flat = (rank + 1) * torch.arange(world * SLICE, dtype=torch.float32)
    before = flat.clone()
    gathered, reduced = torch.empty(world * SLICE), torch.empty(SLICE)
    with rooted_from(0):
        eager_collectives.all_gather_flat(gathered, shard, group)
        eager_collectives.reduce_scatter_flat(reduced, flat, group)
    expected_gather, expected_reduce = torch.empty(world * SLICE), torch.empty(SLICE)
    all_gather_single(expected_gather, shard, group=group)
    reduce_scatter_single(expected_reduce, flat.clone(), op=dist.ReduceOp.SUM, group=group)
    return {
        "gathered": gathered,
        "expected_gather": expected_gather,
        "reduced": reduced,
        "expected_reduce": expected_reduce,
        "flat_untouched": torch.equal(flat, before),
        "rooted_at_16_mib": eager_collectives.uses_rooted_form(torch.empty(4 << 20), group),
        "rooted_below": eager_collectives.uses_rooted_form(torch.empty((4 << 20) - 1), group),
    }


def assert_gathered_and_reduced_as_expected(r: dict, rank: int, world: int) -> None:
    """flat_collectives' inputs: the gather equals the tensor collective's; the reduce too, and
    the closed form (integer-valued sums are exact in any order)."""
    assert torch.equal(r["gathered"], r["expected_gather"])
    assert torch.equal(r["reduced"], r["expected_reduce"])
    own = torch.arange(SLICE, dtype=torch.float32) + rank * SLICE
    assert torch.equal(r["reduced"], own * sum(range(1, world + 1)))


def test_rooted_forms_give_what_the_tensor_collectives_give(pools):
    world = 4
    for rank, r in enumerate(pools(world).run(flat_collectives)):
        assert_gathered_and_reduced_as_expected(r, rank, world)
        assert r["flat_untouched"], "the reduce wrote into the caller's gradient"
        assert r["rooted_at_16_mib"] and not r["rooted_below"]


# hpZ's backward gathers (and qwZ's int8 payloads) run in the node's group: group ranks, not global ones.
CONFIGS = {"zero3": {}, "qwz_hpz": {"ranks_per_node": 2, "hpz_size": 2, "quantize_weights": True}}


@pytest.mark.parametrize(
    ("config", "device", "backend"),
    [
        ("cpu:gloo", "cpu", "gloo"),  # init_process_group() without a backend, on a CPU machine
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:gloo", "cuda", "gloo"),
        ("gloo", "cpu", "gloo"),
        ("cuda:nccl", "cpu", ""),
    ],
)
def test_the_backend_is_read_per_device_from_the_group_config(config, device, backend):
    assert eager_collectives.backend_for_device(config, device) == backend


def eager_step(name: str, config: str, rooted: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = zpp_compile.shard(build(name), zpp_compile.Config(**CONFIGS[config]))
    x, y = batch(name, 2 * world, 0)
    counter = zpp_compile.comm_counter()
    counter.reset()
    with rooted_from(0 if rooted else 1 << 62, piece_bytes=4096) as choices:
        loss = loss_of(name, model, x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
    return {
        "choices": set(choices),
        "loss": loss.item(),
        "bytes": counter.bytes(),
        "grads": {n: local_grad(p) for n, p in model.named_parameters() if p.requires_grad},
    }


@pytest.mark.parametrize(("name", "config"), [("hf_gpt2", "zero3"), ("gpt", "zero3"), ("gpt", "qwz_hpz")])
def test_eager_training_with_every_collective_rooted_gives_the_same_gradients(pools, name, config):
    tensor_forms, rooted = (pools(4).run(eager_step, name, config, r) for r in (False, True))
    for rank in range(4):
        assert rooted[rank]["choices"] == {True} and tensor_forms[rank]["choices"] == {False}
        assert rooted[rank]["loss"] == tensor_forms[rank]["loss"]
        # The counter models the exchange, not gloo's algorithm: the same bytes either way.
        assert rooted[rank]["bytes"] == tensor_forms[rank]["bytes"]
        for param, grad in tensor_forms[rank]["grads"].items():
            torch.testing.assert_close(rooted[rank]["grads"][param], grad, rtol=1e-6, atol=1e-8, msg=param)
