import torch
import torch.distributed._functional_collectives as funcol

from zpp_compile.passes import sink_large_results
from zpp_compile.passes.graph_utils import is_call, shares_input_storage

from .helpers import context, trace

aten = torch.ops.aten
ROWS = 4096  # x 1024 fp32 columns: 16 MiB, sink_large_results.LARGE_BYTES


def _linear_backward(dy, x, w8):
    # A linear layer's backward as autograd emits it, with the weight regathered for the backward
    # (here: "dequantized" from int8): the weight's gradient first, then the input's.
    dw = dy.t() @ x
    w = w8.float() * 0.5
    dx = dy @ w
    return dx, dw * 2


def _inputs():
    return torch.randn(8, ROWS), torch.randn(8, 1024), torch.randint(-127, 128, (ROWS, 1024), dtype=torch.int8)


def _mm_order(gm):
    return [n.args for n in gm.graph.nodes if n.target == aten.mm.default]


def test_the_weight_gradient_is_made_after_the_weight_it_does_not_read_dies(group_of_one):
    gm = trace(_linear_backward, *_inputs())
    (dw_mm, dx_mm) = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    inputs = _inputs()
    before = gm(*inputs)
    gm = sink_large_results(gm, context(group_of_one, phase="backward"))
    # dX reads the dequantized weight last; dW (16 MiB) now comes right after it, so the two
    # 16 MiB tensors are never alive together.
    assert dx_mm.next is dw_mm
    after = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_an_input_larger_than_the_result_that_dies_at_the_new_place_does_not_stop_the_move(group_of_one):
    # The logits' gradient of a large batch: dY (32 MiB) is larger than dW (16 MiB), but dX reads
    # it last, so making dW right after dX keeps dY alive no longer than before.
    dy, x = torch.randn(2048, ROWS), torch.randn(2048, 1024)
    w8 = _inputs()[2]
    gm = trace(_linear_backward, dy, x, w8)
    (dw_mm, dx_mm) = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    before = gm(dy, x, w8)
    gm = sink_large_results(gm, context(group_of_one, phase="backward"))
    assert dx_mm.next is dw_mm
    assert all(torch.equal(a, b) for a, b in zip(gm(dy, x, w8), before))


def test_a_result_whose_move_would_keep_larger_inputs_alive_stays(group_of_one):
    def reads_a_larger_input_last(dy, x, w8, wide):
        half = wide[:, :1024] * 2  # 16 MiB made from a 32 MiB input read for the last time here
        w = w8.float() * 0.5
        dx = dy @ w
        return dx, half + 1

    gm = trace(reads_a_larger_input_last, *_inputs(), torch.randn(ROWS, 2048))
    targets = [n.target for n in gm.graph.nodes]
    gm = sink_large_results(gm, context(group_of_one, phase="backward"))
    assert [n.target for n in gm.graph.nodes] == targets


def test_a_collective_result_read_through_its_wait_is_not_freed_at_the_wait(group_of_one):
    # The wait returns the tensor the all-gather wrote (its schema marks no alias): the gathered
    # 16 MiB stay alive until dW's own reader reads them, so no place before it frees memory and
    # dW stays where autograd made it.
    def gathered_after_dw(dy, x, shard):
        dw = dy.t() @ x
        gathered = funcol.all_gather_tensor(shard, 0, group_of_one)  # all_gather_into_tensor + wait
        return dw + gathered.view(ROWS, 1024), shard.sum()  # the shard outlives dW's reader

    args = torch.randn(8, ROWS), torch.randn(8, 1024), torch.randn(ROWS * 1024)
    gm = trace(gathered_after_dw, *args)
    assert any(is_call(n, WAIT) for n in gm.graph.nodes)
    targets = [n.target for n in gm.graph.nodes]
    gm = sink_large_results(gm, context(group_of_one, phase="backward"))
    assert [n.target for n in gm.graph.nodes] == targets


def test_a_regathered_tied_head_and_its_gradient_are_never_alive_together(group_of_one, monkeypatch):
    """What the pass is for, in the backward the zeropp backend compiles: Hugging Face GPT-2's tied
    head is gathered again for the backward (keep_last_weights_gathered off) and its gradient is
    made after the last read of the gathered weight, so no point of the graph holds both."""
    import importlib

    import zpp_compile

    from ..models import hf_gpt2

    module = importlib.import_module("zpp_compile.passes.sink_large_results")  # not the function
    vocab, width = 4096, 64

    def overlap(large_bytes: int) -> bool:
        monkeypatch.setattr(module, "LARGE_BYTES", large_bytes)
        torch._dynamo.reset()
        model = hf_gpt2(vocab=vocab, width=width, layers=1)
        config = zpp_compile.Config(keep_last_weights_gathered=False, gather_bucket_bytes=0)
        zpp_compile.shard(model, config)
        ids = torch.randint(0, vocab, (2, 16))
        # Uncached: AOTAutograd's cache key does not see LARGE_BYTES.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            torch.compile(model, backend="zeropp")(input_ids=ids, labels=ids).loss.backward()
        graph = zpp_compile.compiled_graphs()[-1].backward.graph
        (weight,) = [n for n in graph.nodes if is_call(n, WAIT) and n.meta["val"].numel() == vocab * width]
        (grad,) = [n for n in graph.nodes if is_call(n, aten.mm.default) and n.meta["val"].shape == (vocab, width)]
        return _alive(grad) & _alive(weight) != set()

    assert overlap(large_bytes=2**62)  # the order autograd emits: the gradient first
    assert not overlap(large_bytes=vocab * width * 4 // 2)


WAIT = torch.ops._c10d_functional.wait_tensor.default


def _alive(node) -> set:
    """The nodes during which node's storage is alive: from it to its last reader (through views)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    death, stack = order[node], [node]
    while stack:
        for user in stack.pop().users:
            death = max(death, order[user])
            if shares_input_storage(user):
                stack.append(user)
    return {n for n, i in order.items() if order[node] <= i <= death}
