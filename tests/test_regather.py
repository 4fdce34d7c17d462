"""Eager ZeRO-3 keeps no gathered weight from forward to backward (zpp_compile/regather.py)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import zpp_compile

from .models import batch, build, local_grad, loss_of

WIDTH, DEPTH = 128, 4


def _linear_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))


class _NoBlocks(nn.Module):
    """Named layers, no repeated block: only the last weight autograd saves stays gathered (not
    the bias read after it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = (nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


_BUILT_HERE = {"linears": _linear_stack, "no_blocks": _NoBlocks}


class _GatheredWeights(TorchDispatchMode):
    """Weak references to the storage of every weight the eager forward gathers."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[StorageWeakRef] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.zpp.gather_param.default:
            self.storages.append(StorageWeakRef(out.untyped_storage()))
        return out

    def live(self) -> int:
        return sum(not s.expired() for s in self.storages)


def eager_step(name: str, save_gathered_weights: bool, user_hooks: bool = False, keep_last: bool = True) -> dict:
    """One eager forward and backward: how many gathered weights are still live after the forward
    (the loss holds the graph), the backward's all-gathers and the gradient shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _BUILT_HERE[name]() if name in _BUILT_HERE else build(name)
    config = zpp_compile.Config(save_gathered_weights=save_gathered_weights, keep_last_weights_gathered=keep_last)
    zpp_compile.shard(model, config)
    if name in _BUILT_HERE:
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
        forward = lambda: model(x).square().mean()  # noqa: E731
    else:
        x, y = batch(name, 2 * world, 0)
        forward = lambda: loss_of(name, model, x.chunk(world)[rank], y.chunk(world)[rank])  # noqa: E731
    packed_shapes: list[tuple[int, ...]] = []

    def user_pack(t: torch.Tensor) -> torch.Tensor:
        packed_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(user_pack, lambda t: t) if user_hooks else contextlib.nullcontext():
        with _GatheredWeights() as gathered:
            loss = forward()
    dist.barrier()  # gloo holds a collective's tensors until the next one: release the last gather's
    gc.collect()  # garbage in a reference cycle is not held; when the collector runs depends on the tests before
    live_after_forward = gathered.live()
    gc.disable()  # a weight held by a reference cycle would outlive its backward until the collector ran
    try:
        with zpp_compile.comm_counter().trace() as issued:
            loss.backward()
        dist.barrier()
        live_after_backward = gathered.live()
    finally:
        gc.enable()
    return {
        "gathered": len(gathered.storages),
        "live_after_forward": live_after_forward,
        "live_after_backward": live_after_backward,
        "backward_gathers": sum(c.op == "all_gather" and c.phase == "backward" for c in issued),
        "grads": {n: local_grad(p) for n, p in model.named_parameters() if p.requires_grad},
        "user_packed_weights": packed_shapes.count((WIDTH, WIDTH)),
    }


def test_the_backward_gathers_again_instead_of_keeping_the_forwards_weights(pools):
    regathered, kept = (pools(2).run(eager_step, "linears", save) for save in (False, True))
    for rank in range(2):
        # Kept, the weights of the layers after the first stay gathered from forward to backward
        # (addmm saves a weight for its input's gradient, and no bias); regathered, none does.
        assert (regathered[rank]["gathered"], kept[rank]["gathered"]) == (2 * DEPTH, 2 * DEPTH)
        assert (regathered[rank]["live_after_forward"], kept[rank]["live_after_forward"]) == (0, DEPTH - 1)
        assert (regathered[rank]["backward_gathers"], kept[rank]["backward_gathers"]) == (DEPTH - 1, 0)
        for name, grad in kept[rank]["grads"].items():
            assert torch.equal(regathered[rank]["grads"][name], grad), name


@pytest.mark.parametrize("name", ["hf_gpt2_dropout", "hf_llama"])
def test_regathered_weights_give_the_kept_weights_gradients_on_models_we_did_not_write(pools, name):
    # GPT-2 ties lm_head to the embedding and drops out (the seed is the same in both runs); Llama's
    # nn.Linear saves a transposed view of the weight.
    regathered, tail_kept, kept = (
        pools(2).run(eager_step, name, save, False, keep_last)
        for save, keep_last in ((False, False), (False, True), (True, False))
    )
    # The weights outside the blocks the forward reads last: GPT-2's final norm and tied head
    # (weight, bias, embedding), Llama's final norm and head.
    tail = {"hf_gpt2_dropout": 3, "hf_llama": 2}[name]
    for rank in range(2):
        assert regathered[rank]["live_after_forward"] == 0 < kept[rank]["live_after_forward"]
        assert regathered[rank]["backward_gathers"] == kept[rank]["live_after_forward"]
        assert tail_kept[rank]["live_after_forward"] == tail
        assert tail_kept[rank]["live_after_backward"] == regathered[rank]["live_after_backward"] == 0
        assert tail_kept[rank]["backward_gathers"] == regathered[rank]["backward_gathers"] - tail
        for param, grad in kept[rank]["grads"].items():
            assert torch.equal(regathered[rank]["grads"][param], grad), param
            assert torch.equal(tail_kept[rank]["grads"][param], grad), param


@pytest.mark.parametrize("keep_last", [False, True])
def test_without_repeated_blocks_only_the_last_weight_read_stays_gathered(pools, keep_last):
    regathered, kept = (pools(2).run(eager_step, "no_blocks", save, False, keep_last) for save in (False, True))
    for rank in range(2):
        # Kept whole, `middle` and `last` (the first layer's input needs no gradient).
        assert kept[rank]["live_after_forward"] == 2
        assert regathered[rank]["live_after_forward"] == int(keep_last)
        assert regathered[rank]["live_after_backward"] == 0
        assert regathered[rank]["backward_gathers"] == 2 - int(keep_last)
        for param, grad in kept[rank]["grads"].items():
            assert torch.equal(regathered[rank]["grads"][param], grad), param


def test_the_users_own_saved_tensor_hooks_stay_in_charge(pools):
    # Activation offloading or a user's hooks around the model see the weights as before.
    results = pools(2).run(eager_step, "linears", False, True)
    assert all(r["user_packed_weights"] == DEPTH - 1 and r["backward_gathers"] == 0 for r in results)


def test_an_empty_tensor_is_never_taken_for_a_gathered_weight():
    # Every empty storage has address 0: an empty weight must not claim them.
    from zpp_compile import regather

    weight = torch.empty(0)
    regather.remember(weight, lambda: torch.empty(0))
    indices = torch.empty(0, dtype=torch.int64)
    assert regather._pack(indices) is indices
