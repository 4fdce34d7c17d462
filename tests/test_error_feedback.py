"""qgZ's error-feedback state (zpp::ef_load / zpp::ef_store), called as the compiled backward calls them."""

import math

import pytest
import torch

from zpp_compile.error_feedback import SharedErrorSlotError, clear_error_feedback, new_slot


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    clear_error_feedback()


def _store_in_backward(slot: int, residual: torch.Tensor, times: int) -> None:
    """Run ef_store `times` times inside one autograd backward, as a compiled backward graph does."""

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            for _ in range(times):
                torch.ops.zpp.ef_store(residual, slot)
            return grad

    Reduce.apply(torch.ones(1, requires_grad=True)).sum().backward()


def test_first_load_is_zero_then_the_stored_error_comes_back():
    slot, like = new_slot(), torch.zeros(4)
    assert torch.equal(torch.ops.zpp.ef_load(like, slot), like)
    _store_in_backward(slot, torch.tensor([0.5, -0.25, 1e-3, 0.0]), times=1)
    back = torch.ops.zpp.ef_load(like, slot)
    assert torch.allclose(back, torch.tensor([0.5, -0.25, 1e-3, 0.0]), rtol=2**-7)  # bf16 state


def test_beta_keeps_that_share_of_the_stored_error_starting_from_zeros():
    """LoCo's err_beta: stored = beta * stored + (1 - beta) * this step's error."""
    slot, like, beta = new_slot(), torch.zeros(2), 0.75
    for residual in (torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])):
        torch.ops.zpp.ef_store(residual, slot, beta)
    expected = beta * (1 - beta) * torch.tensor([1.0, -2.0]) + (1 - beta) * torch.tensor([0.5, 0.5])
    assert torch.equal(torch.ops.zpp.ef_load(like, slot), expected)  # [0.3125, -0.25]: exact in bf16
    torch.ops.zpp.ef_store(torch.tensor([3.0, 1.0]), slot, 0.0)  # beta 0: the whole last error
    assert torch.equal(torch.ops.zpp.ef_load(like, slot), torch.tensor([3.0, 1.0]))


def test_a_non_finite_error_is_dropped_not_fed_back():
    slot = new_slot()
    _store_in_backward(slot, torch.tensor([1.0, math.nan, math.inf, -2.0]), times=1)
    back = torch.ops.zpp.ef_load(torch.zeros(4), slot)
    assert torch.equal(back, torch.tensor([1.0, 0.0, 0.0, -2.0]))


def test_one_slot_stored_twice_in_one_backward_is_refused():
    slot = new_slot()
    _store_in_backward(slot, torch.ones(3), times=1)
    _store_in_backward(slot, torch.ones(3), times=1)  # the next backward: fine
    with pytest.raises(SharedErrorSlotError, match="Compile the whole model once"):
        _store_in_backward(slot, torch.ones(3), times=2)
