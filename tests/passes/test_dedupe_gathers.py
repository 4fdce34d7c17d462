import torch

import zpp_compile  # noqa: F401
from zpp_compile.passes import dedupe_gathers

from .helpers import context, targets, trace

gather = torch.ops.zpp.gather_param.default


def test_tied_weight_read_twice_is_gathered_once(group_of_one):
    def f(shard, x):
        a = torch.ops.zpp.gather_param(shard, 12, [4, 3], 12, 1, group_of_one)
        b = torch.ops.zpp.gather_param(shard, 12, [4, 3], 12, 1, group_of_one)
        return (x @ a.t()) @ b

    shard, x = torch.randn(12), torch.randn(2, 3)
    gm = trace(f, shard, x)
    expected = gm(shard, x)
    assert targets(gm).count(gather) == 2
    gm = dedupe_gathers(gm, context(group_of_one))
    assert targets(gm).count(gather) == 1
    torch.testing.assert_close(gm(shard, x), expected)


def test_gathers_of_different_parameters_are_kept(group_of_one):
    def f(s1, s2):
        return torch.ops.zpp.gather_param(s1, 4, [4], 4, 1, group_of_one) + torch.ops.zpp.gather_param(
            s2, 4, [4], 4, 1, group_of_one
        )

    gm = trace(f, torch.randn(4), torch.randn(4))
    code = gm.code
    assert dedupe_gathers(gm, context(group_of_one)).code == code
