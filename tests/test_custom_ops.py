"""torch.library.opcheck on zpp's custom ops: each fake kernel says what the real one returns
(shape, dtype and strides), on the non-contiguous inputs the passes may hand them. Inductor checks
a region's input strides against the fake kernel's, so a mismatch fails a compiled step (ef_load
did, under regions, at the second step). The collectives run on a real one-rank gloo group; their
results across ranks are tested in tests/test_rooted_ops.py and test_training.py."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import zpp_compile  # noqa: F401  (registers the ops)
from zpp_compile import grad_sync, scatter_ops  # noqa: F401
from zpp_compile.error_feedback import clear_error_feedback, new_slot


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    clear_error_feedback()
    grad_sync.clear_gradient_buffers()


def _transposed(*shape: int) -> torch.Tensor:
    """A [a, b, ...] view of a contiguous [b, a, ...] tensor, as qgZ's in-node stage loads its error."""
    return torch.randn(shape[1], shape[0], *shape[2:]).transpose(0, 1)


def test_ef_load_returns_a_contiguous_error_with_and_without_a_stored_one():
    like = _transposed(2, 2, 8)
    slot = new_slot()
    opcheck(torch.ops.zpp.ef_load, (like, slot))  # nothing stored: zeros
    torch.ops.zpp.ef_store(torch.randn(2, 2, 8), slot)
    opcheck(torch.ops.zpp.ef_load, (like, slot))
    # Contiguous whatever the input's layout: Inductor may lay out `like` otherwise than traced.
    for layout in (like, like.contiguous()):
        loaded = torch.ops.zpp.ef_load(layout, slot)
        assert loaded.is_contiguous() and loaded.abs().sum() > 0


@pytest.mark.parametrize("beta", [0.0, 0.8])
def test_ef_store(beta):
    slot = new_slot()
    torch.ops.zpp.ef_store(torch.randn(2, 3, 8), slot, beta)  # something stored to blend with
    opcheck(torch.ops.zpp.ef_store, (_transposed(2, 3, 8), slot, beta))


def test_add_rows():
    # The embedding's backward: a mask over the token positions, rows repeated and out of range.
    grad, index = torch.zeros(7, 4), torch.tensor([[0, 6, 6], [-1, 2, 9]])
    opcheck(torch.ops.zpp.add_rows, (grad, (index != 2).unsqueeze(-1), index, torch.randn(2, 3, 4)))


@pytest.mark.parametrize(
    "name", ["gather_param", "replicated_param", "reduce_grad", "all_reduce_grad", "rooted_all_gather", "owned_slot"]
)
def test_collective_ops_on_a_group_of_one(group_of_one, name):
    part = torch.randn(6, 8)[:, 2:5]  # a strided 6 x 3 part
    args = {
        "gather_param": (part, 18, [6, 3], 18, 1, group_of_one),
        "replicated_param": (part, 1, group_of_one),
        "reduce_grad": (part, 18, 18, 1, group_of_one),
        "all_reduce_grad": (part, 1, group_of_one),
        "rooted_all_gather": (torch.randn(8), 1, group_of_one),
        "owned_slot": (torch.randn(6, 8)[:, 2:4].reshape(-1), 1, group_of_one),
    }[name]
    opcheck(getattr(torch.ops.zpp, name), args, test_utils=("test_schema", "test_faketensor"))


def test_a_rooted_result_dropped_unwaited_frees_its_address_for_the_next_one(group_of_one):
    # opcheck runs an op and drops its result, and so does a step that fails between an issue and
    # its wait; the allocator then hands the same memory to the next rooted result. CI failed on
    # that once (test_collective_ops_on_a_group_of_one[rooted_all_gather]) when the table of
    # collectives in flight still held the dropped one's address.
    seen, reused = set(), 0
    for _ in range(64):
        out = torch.ops.zpp.rooted_all_gather(torch.randn(8), 1, group_of_one)
        reused += out.data_ptr() in seen
        seen.add(out.data_ptr())
        del out
    assert reused > 0, "the allocator never reused an address: this test checked nothing"
    shard = torch.randn(8)
    live = torch.ops.zpp.rooted_all_gather(shard, 1, group_of_one)
    torch.ops.zpp.wait_rooted(live)  # raises if the issue above was not recorded
    assert torch.equal(live, shard)


def test_gradient_accumulation_ops():
    grad = _transposed(3, 4)
    opcheck(torch.ops.zpp.accumulate_grad, (grad, 0, "w"))
    opcheck(torch.ops.zpp.flush_grad, (grad, 0, "w"))
