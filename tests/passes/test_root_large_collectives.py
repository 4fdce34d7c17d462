import pytest
import torch

import zpp_compile  # noqa: F401
from zpp_compile import eager_collectives
from zpp_compile.passes import bucket_collectives, lower_reduce, root_large_collectives

from .helpers import context, gathered_layers, targets, trace

c10d = torch.ops._c10d_functional
zpp = torch.ops.zpp
aten = torch.ops.aten


@pytest.fixture
def every_tensor_rooted(monkeypatch):
    monkeypatch.setattr(eager_collectives, "ROOTED_MIN_BYTES", 0)


def reduced(group: str, numel: int, shard_numel: int):
    """A gradient of `numel` elements lowered to a reduce-scatter of `shard_numel` (padded if more)."""
    grad = torch.randn(numel)
    gm = trace(lambda g: torch.ops.zpp.reduce_grad(g, numel, shard_numel, 1, group), grad)
    return lower_reduce(gm, context(group, phase="backward")), grad


def only(gm, target):
    (node,) = [n for n in gm.graph.nodes if n.target == target]
    return node


def test_a_padded_gradient_is_reduced_in_place_of_its_padded_copy(group_of_one, every_tensor_rooted):
    gm, grad = reduced(group_of_one, 10, 12)
    expected = gm(grad)
    gm = root_large_collectives(gm, context(group_of_one, phase="backward"))
    after = targets(gm)
    assert c10d.reduce_scatter_tensor.default not in after and c10d.wait_tensor.default not in after
    issued, wait = only(gm, zpp.rooted_reduce_scatter.default), only(gm, zpp.wait_rooted.default)
    assert issued.args[0].target == aten.constant_pad_nd.default
    # Compiled whole by Inductor: the wait reads the padded copy, so its buffer is not reused early.
    assert wait.args == (issued, issued.args[0])
    torch.testing.assert_close(gm(grad), expected)


def matmul_reduced(group: str, write_rows: bool = False):
    """A 5 x 2 gradient a matmul returns, lowered to a reduce-scatter padded to 12 elements; with
    `write_rows`, a tied embedding's rows added into it first (fold_scatter_grads' in-place form)."""

    def grad(a, b, index, rows):
        g = a @ b
        if write_rows:
            torch.ops.zpp.add_rows(g, torch.ones(3, 1, dtype=torch.bool), index, rows)
        return torch.ops.zpp.reduce_grad(g, 10, 12, 1, group)

    args = (torch.randn(5, 3), torch.randn(3, 2), torch.tensor([4, 0, 4]), torch.randn(3, 2))
    gm = trace(grad, *args)
    return lower_reduce(gm, context(group, phase="backward")), args


@pytest.mark.parametrize("write_rows", [False, True], ids=["matmul", "rows_written_into_it"])
def test_a_gradient_of_its_own_is_reduced_without_its_zero_pad(group_of_one, every_tensor_rooted, write_rows):
    gm, args = matmul_reduced(group_of_one, write_rows)
    assert aten.constant_pad_nd.default in targets(gm)
    expected = gm(*args)
    gm = root_large_collectives(gm, context(group_of_one, phase="backward"))
    after = targets(gm)
    # The pad's whole-tensor copy is gone: the rooted reduce takes the flattened matmul result
    # and the shard's size, and zero-fills the shard's tail itself.
    assert aten.constant_pad_nd.default not in after and c10d.reduce_scatter_tensor.default not in after
    issued = only(gm, zpp.rooted_reduce_scatter.default)
    assert issued.args[0].target == aten.view.default and issued.args[0].args[0].target == aten.mm.default
    assert issued.args[1:3] == (12, 1)
    got = gm(*args)
    assert torch.equal(got, expected) and torch.equal(got[10:], torch.zeros(2))


def test_a_gradient_read_elsewhere_keeps_its_pad(group_of_one, every_tensor_rooted):
    def reduce_and_read(a, b):
        g = a @ b
        return torch.ops.zpp.reduce_grad(g, 10, 12, 1, group_of_one), g.sum()

    gm = lower_reduce(
        trace(reduce_and_read, torch.randn(5, 3), torch.randn(3, 2)), context(group_of_one, phase="backward")
    )
    gm = root_large_collectives(gm, context(group_of_one, phase="backward"))
    # Rooted, but in the padded copy: the reduce writes into its input, which `g.sum()` reads.
    assert only(gm, zpp.rooted_reduce_scatter.default).args[0].target == aten.constant_pad_nd.default


def test_run_as_fx_nodes_the_wait_does_not_hold_the_input(group_of_one, every_tensor_rooted):
    gm, _ = reduced(group_of_one, 10, 12)
    gm = root_large_collectives(gm, context(group_of_one, phase="backward", lowering="aot_eager"))
    assert only(gm, zpp.wait_rooted.default).args[1] is None


def test_a_gradient_the_collective_does_not_own_keeps_the_functional_form(group_of_one, every_tensor_rooted):
    gm, _ = reduced(group_of_one, 12, 12)  # unpadded: the collective reads a view of the graph input
    code = gm.code
    assert root_large_collectives(gm, context(group_of_one, phase="backward")).code == code


def test_a_padded_copy_read_elsewhere_keeps_the_functional_form(group_of_one, every_tensor_rooted):
    def reduce_and_read_the_copy(g):
        padded = torch.nn.functional.pad(g, (0, 2))
        r = c10d.wait_tensor(c10d.reduce_scatter_tensor(padded, "sum", 1, group_of_one))
        return r, padded.sum()

    gm = trace(reduce_and_read_the_copy, torch.randn(10))
    code = gm.code
    assert root_large_collectives(gm, context(group_of_one, phase="backward")).code == code


def test_collectives_below_the_threshold_keep_the_functional_form(group_of_one):
    gm, _ = reduced(group_of_one, 10, 12)
    code = gm.code
    assert root_large_collectives(gm, context(group_of_one, phase="backward")).code == code


@pytest.mark.parametrize(
    "lowering",
    # A bucketed gather is all_gather_out(cat, out=buffer) by region, all_gather(cat) compiled whole.
    [({"inductor_regions": True}, c10d.all_gather_into_tensor_out), ({}, c10d.all_gather_into_tensor)],
    ids=["regions", "whole"],
)
def test_gathers_and_bucketed_gathers_are_rooted(group_of_one, every_tensor_rooted, lowering):
    config, bucketed_form = lowering
    for bucketed in (False, True):
        gm, args = gathered_layers(group_of_one)
        expected = gm(*args)
        if bucketed:
            gm = bucket_collectives(gm, context(group_of_one, **config))
            assert bucketed_form.default in targets(gm)
        gm = root_large_collectives(gm, context(group_of_one, **config))
        after = targets(gm)
        gathers = [c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default]
        assert not set(gathers) & set(after)
        assert (
            after.count(zpp.rooted_all_gather.default) == after.count(zpp.wait_rooted.default) == (1 if bucketed else 3)
        )
        # Bucketing's output buffer (and any copy into this rank's slot) went with the gather.
        assert aten.copy_.default not in after and aten.empty.memory_format not in after
        torch.testing.assert_close(gm(*args), expected)


@pytest.mark.parametrize(
    "copy",
    [
        pytest.param(lambda g: g.clone(), id="clone"),  # Inductor's no-op removal would drop it
        pytest.param(lambda g: torch.cat([g]), id="one_part_cat"),
        pytest.param(lambda g: torch.nn.functional.pad(g, (0, 0)), id="zero_pad"),
        pytest.param(lambda g: torch.ops.aten._unsafe_view(g, [-1]), id="unsafe_view"),
    ],
)
def test_a_copy_inductor_may_drop_keeps_the_functional_form(group_of_one, every_tensor_rooted, copy):
    # Rooted, the reduce would write into `g` itself, which the graph also returns.
    def reduce_a_copy(g):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(copy(g), "sum", 1, group_of_one)), g * 2

    gm = trace(reduce_a_copy, torch.randn(12))
    code = gm.code
    assert root_large_collectives(gm, context(group_of_one, phase="backward")).code == code


def test_a_collective_of_a_matrix_keeps_the_functional_form(group_of_one, every_tensor_rooted):
    # The rooted forms return flat tensors: a 2-D gather's readers would get the wrong shape.
    def gather_a_matrix(w, x):
        return x @ c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, group_of_one)).t()

    gm = trace(gather_a_matrix, torch.randn(8, 4), torch.randn(3, 4))
    code = gm.code
    assert root_large_collectives(gm, context(group_of_one)).code == code
