import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import zpp_compile  # noqa: F401
from zpp_compile.passes import check_no_gathered_weight_saved, tag_gathers_for_recompute
from zpp_compile.passes.recompute import GatheredWeightSavedError

from .helpers import context, trace


def _linear_graph(group_name):
    def f(shard, x):
        w = torch.ops.zpp.gather_param(shard, 12, [4, 3], 12, 1, group_name)
        return torch.relu(x @ w.t())

    return trace(f, torch.randn(12), torch.randn(2, 3))


def test_gather_and_its_views_are_tagged_must_recompute(group_of_one):
    gm = tag_gathers_for_recompute(_linear_graph(group_of_one), context(group_of_one))
    tagged = {n.target for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert torch.ops.zpp.gather_param.default in tagged
    assert torch.ops.aten.t.default in tagged  # the transposed weight is a full-size weight too
    assert torch.ops.aten.mm.default not in tagged
    assert torch.ops.aten.relu.default not in tagged


def test_check_rejects_a_forward_that_saves_a_gathered_weight(group_of_one):
    def saves_weight(shard, x):
        w = torch.ops.zpp.gather_param(shard, 12, [4, 3], 12, 1, group_of_one)
        return x @ w.t(), w.t()  # second output = "saved for backward"

    fw = trace(saves_weight, torch.randn(12), torch.randn(2, 3))
    with pytest.raises(GatheredWeightSavedError, match="saved gathered weights"):
        check_no_gathered_weight_saved(fw, fw, context(group_of_one))
    check_no_gathered_weight_saved(fw, fw, context(group_of_one, save_gathered_weights=True))


def test_check_accepts_a_forward_that_saves_only_activations_and_shards(group_of_one):
    def saves_shard(shard, x):
        w = torch.ops.zpp.gather_param(shard, 12, [4, 3], 12, 1, group_of_one)
        return x @ w.t(), shard, x

    fw = trace(saves_shard, torch.randn(12), torch.randn(2, 3))
    check_no_gathered_weight_saved(fw, fw, context(group_of_one))
