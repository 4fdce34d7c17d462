"""fold_scatter_grads: a tied embedding's gradient rows are added into the head's gradient, not
into a zero-filled whole-weight buffer that is then summed (and padded)."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import zpp_compile  # noqa: F401
from zpp_compile.passes import fold_scatter_grads
from zpp_compile.passes.fold_scatter_grads import scatter_rows_padded

from .helpers import context, targets

aten = torch.ops.aten
VOCAB, WIDTH = 50, 8


def tied_grad(pad: int, padding_idx: int = -1, scatter_first: bool = False):
    """The head's gradient plus the embedding's (Inductor's decomposition: a masked scatter into
    zeros), flattened and zero-padded by `pad` as lower_reduce leaves it (pad 0: not flattened)."""

    def grad(head, index, rows):
        scattered = aten.embedding_dense_backward(rows, index, VOCAB, padding_idx, False)
        summed = scattered + head if scatter_first else head + scattered
        return F.pad(summed.view(-1), (0, pad)) if pad else summed

    return grad


def backward(group: str):
    """The backward's context with Inductor's decompositions, as the backend passes them."""
    return dataclasses.replace(context(group, phase="backward"), decompositions=select_decomp_table())


def traced(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def example(repeats: bool = True):
    torch.manual_seed(0)
    index = torch.randint(0, VOCAB, (2, 12)) if repeats else torch.randperm(VOCAB)[:24].view(2, 12)
    return torch.randn(VOCAB, WIDTH), index, torch.randn(2, 12, WIDTH)


@pytest.mark.parametrize("scatter_first", [False, True])
@pytest.mark.parametrize("pad", [0, 16, 13], ids=["unpadded", "whole_rows", "part_of_a_row"])
def test_scatter_is_folded_into_the_sum(group_of_one, pad, scatter_first):
    args = example()
    gm = traced(tied_grad(pad, scatter_first=scatter_first), *args)
    assert aten._unsafe_masked_index_put_accumulate.default in targets(gm)  # the pattern is really there
    expected = gm(*args)

    gm = fold_scatter_grads(gm, backward(group_of_one))
    after = targets(gm)
    assert aten.full.default not in after
    assert not [n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.meta["val"].shape == (VOCAB, WIDTH)]
    assert (aten.index_put.default in after) == bool(pad)
    assert (aten._unsafe_masked_index_put_accumulate.default in after) == (not pad)
    got = gm(*args)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)  # rows the batch hits twice round differently


@pytest.mark.parametrize("pad", [0, 16, 13])
def test_rows_hit_once_and_masked_rows_are_bitwise_equal(group_of_one, pad):
    head, index, rows = example(repeats=False)
    index[0, 0] = 7  # the padding index: masked, adds nothing
    gm = traced(tied_grad(pad, padding_idx=7), head, index, rows)
    expected = gm(head, index, rows)
    got = fold_scatter_grads(gm, backward(group_of_one))(head, index, rows)
    assert torch.equal(got, expected)


def head_from_matmul(pad: int, read_head_again: bool = False, padding_idx: int = -1):
    """tied_grad with the head's gradient a matmul result (as in a model's backward), not an input."""

    def grad(hidden, grad_logits, index, rows):
        head = grad_logits.t() @ hidden
        summed = tied_grad(pad, padding_idx)(head, index, rows)
        return (summed, head.sum()) if read_head_again else summed

    return grad


def matmul_example(repeats: bool = True):
    _, index, rows = example(repeats)
    return torch.randn(6, WIDTH), torch.randn(6, VOCAB), index, rows


@pytest.mark.parametrize("pad", [0, 16, 13], ids=["unpadded", "whole_rows", "part_of_a_row"])
def test_rows_go_into_a_head_gradient_of_its_own_in_place(group_of_one, pad):
    args = matmul_example()
    gm = traced(head_from_matmul(pad), *args)
    expected = gm(*args)
    gm = fold_scatter_grads(gm, backward(group_of_one))
    after = targets(gm)
    # No whole-weight tensor is made for the sum: the rows are written into the matmul's result,
    # which the reduction's pad (if any) then reads.
    assert torch.ops.zpp.add_rows.default in after
    assert not {aten.full.default, aten.index_put.default, aten._unsafe_masked_index_put_accumulate.default} & set(
        after
    )
    (write,) = [n for n in gm.graph.nodes if n.target is torch.ops.zpp.add_rows.default]
    assert write.args[0].target is aten.mm.default
    torch.testing.assert_close(gm(*args), expected)

    # Rows hit once and masked rows (the padding index) are bitwise the same.
    once = matmul_example(repeats=False)
    once[2][0, 0] = 7
    gm = traced(head_from_matmul(pad, padding_idx=7), *once)
    expected = gm(*once)
    assert torch.equal(fold_scatter_grads(gm, backward(group_of_one))(*once), expected)


def test_a_head_gradient_read_elsewhere_is_not_written_into(group_of_one):
    args = matmul_example()
    gm = fold_scatter_grads(traced(head_from_matmul(16, read_head_again=True), *args), backward(group_of_one))
    after = targets(gm)
    assert torch.ops.zpp.add_rows.default not in after and aten.index_put.default in after


@pytest.mark.parametrize("pad", [16, 13], ids=["whole_rows", "part_of_a_row"])
def test_inductor_holds_one_whole_weight_buffer_less(group_of_one, pad):
    """What the pass is for: Inductor's code for the padded sum allocates one whole-weight buffer
    (the padded result) instead of two (the zero-filled scatter and the padded sum)."""
    args = example()

    def whole_weight_buffers(fold: bool) -> int:
        def backend(gm, inputs):
            from torch._inductor.compile_fx import compile_fx

            def inner(gm, inputs, **kwargs):
                if fold:
                    gm = fold_scatter_grads(gm, backward(group_of_one))
                from torch._inductor.compile_fx import compile_fx_inner

                return compile_fx_inner(gm, inputs, **kwargs)

            return compile_fx(gm, inputs, inner_compile=inner)

        torch._dynamo.reset()
        # Uncached: AOTAutograd's cache key does not see inner_compile, so the second call would
        # read the first one's kernels back.
        with torch._functorch.config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
            _, (code,) = run_and_get_code(torch.compile(tied_grad(pad), backend=backend), *args)
        sizes = re.findall(r"empty_strided_cpu\(\((\d+), ?(\d*)\)?", code)
        return sum(1 for a, b in sizes if int(a) * int(b or 1) >= VOCAB * WIDTH)

    assert whole_weight_buffers(fold=False) == 2
    assert whole_weight_buffers(fold=True) == 1


@pytest.mark.parametrize("pad", [16, 13])
def test_padded_form_adds_as_the_masked_scatter_does(pad):
    """scatter_rows_padded against the op it stands for, with what an embedding never sends:
    negative and out-of-range indices, and a mask of its own."""
    torch.manual_seed(1)
    head, rows = torch.randn(VOCAB, WIDTH), torch.randn(3, 7, WIDTH)
    index = torch.randint(-2 * VOCAB, 2 * VOCAB, (3, 7))
    mask = torch.rand(3, 7, 1) > 0.3
    expected = F.pad(aten._unsafe_masked_index_put_accumulate(head, mask, [index], rows).view(-1), (0, pad))
    torch.testing.assert_close(scatter_rows_padded(head, mask, index, rows, pad), expected)


def test_symbolic_shapes_take_the_unpadded_form(group_of_one):
    """Under dynamic shapes the tokens' count is a SymInt: the padded form (traced torch code) is
    not used, the scatter still goes into the head's gradient."""
    args = example()
    gm = make_fx(tied_grad(13), decomposition_table=select_decomp_table(), tracing_mode="symbolic")(*args)
    expected = gm(*args)
    gm = fold_scatter_grads(gm, backward(group_of_one))
    after = targets(gm)
    assert aten.full.default not in after and aten.index_put.default not in after
    assert aten._unsafe_masked_index_put_accumulate.default in after
    torch.testing.assert_close(gm(*args), expected)


def test_sums_it_cannot_prove_are_left_alone(group_of_one):
    head, index, rows = example()

    def scaled(head, index, rows):  # alpha: not a plain sum
        return torch.add(head, aten.embedding_dense_backward(rows, index, VOCAB, -1, False), alpha=2)

    def zeros_read_twice(head, index, rows):  # the scatter's result is read elsewhere too
        scattered = aten.embedding_dense_backward(rows, index, VOCAB, -1, False)
        return head + scattered, scattered.sum()

    def strided_head(head, index, rows):  # the sum's layout is not the head gradient's
        return aten.embedding_dense_backward(rows, index, VOCAB, -1, False) + head.t().contiguous().t()

    for fn in (scaled, zeros_read_twice, strided_head):
        gm = traced(fn, head, index, rows)
        code = gm.code
        assert fold_scatter_grads(gm, backward(group_of_one)).code == code, fn.__name__
