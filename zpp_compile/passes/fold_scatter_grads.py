"""fold_scatter_grads: add an embedding's gradient rows straight into the gradient they are summed with.

A tied weight (the token embedding that is also the LM head, in most language models) gets two
gradients in the backward, and autograd adds them. The embedding's is a scatter of the batch's
rows into a zero-filled buffer of the whole weight, and the reduction then pads the sum to whole
shards: three whole-weight tensors at once (the head's gradient, the zero-filled buffer and the
padded sum; 441 MB for GPT-2's 50257 x 768 embedding, the backward's peak under Inductor).
Scattering the rows into the head's gradient holds at most two, and one where the head's
gradient is a buffer only the sum reads (a matmul's result): the rows are written into it.

Before (lower_reduce or qgz has run):
         z = aten.full([V, C], 0)
         s = aten._unsafe_masked_index_put_accumulate(z, mask, [idx], rows)     rows: [*idx.shape, C]
         g = aten.add(other, s)                                                (either order)
         flat = aten.constant_pad_nd(aten.view(g, [-1]), [0, pad])             (the reduction's padding)
After, in place (`other` is a buffer of its own only the sum reads; graph_utils.is_fresh_buffer):
         zpp.add_rows(other, mask, idx, rows)                                  (scatter_ops.py)
         flat = aten.constant_pad_nd(aten.view(other, [-1]), [0, pad])
After, padded (static shapes):
         flat = aten.index_put(pad(other, pad // C rows), [row(idx)], where(mask, rows, 0), True).view(-1)
         (a pad of part of a row: into the flat copy, at row(idx) * C + arange(C))
After, not padded (the sum has other readers, or shapes are symbolic):
         g = aten._unsafe_masked_index_put_accumulate(other, mask, [idx], rows)

In place, the pad that follows is a copy of `other` (a second whole-weight tensor) unless the
reduction takes the unpadded tensor: root_large_collectives' rooted reduce-scatter does. The write
runs between regions in a graph compiled by region (zpp.add_rows is a region boundary), where the
head's gradient is the last region's input, which Inductor never overwrites. The pass runs after
the scheduling passes: they move a collective's inputs up to its start by data dependence, which
does not see the write.

The sum is the same up to rounding: a row the batch hits k times is added to `other` one token at
a time ((other + r1) + r2 ...) instead of as its own sum first (other + (r1 + r2 ...)); a row hit
once is bitwise the same. Only that exact pattern is rewritten: a zero fill read by nothing else, a
scatter whose only reader is the add, one index tensor into a 2-D weight, both operands of the
add's shape, strides and dtype (no broadcast, no type promotion, no relayout) and no `alpha`.
Indices keep the masked op's meaning: clamped to [-V, V - 1], negative ones counted from the end,
masked rows add zero. qgZ's traced reduction pads the gradient the same way, so it gets the
same forms.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ..scatter_ops import masked_rows
from .context import PassContext
from .graph_utils import (
    aten,
    calls,
    finish,
    has_static_geometry,
    inline_traced,
    insert_call,
    is_call,
    is_fresh_buffer,
    replace_node,
    tensor_val,
    zero_pad_at_end,
)

log = logging.getLogger(__name__)

zpp = torch.ops.zpp
_SCATTER = aten._unsafe_masked_index_put_accumulate.default


def fold_scatter_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    folded = 0
    for add in list(calls(gm.graph, aten.add.Tensor)):
        match = _scatter_operand(add)
        if match is None:
            continue
        scatter, other = match
        padding = _padding_of(add)
        if is_fresh_buffer(other) and len(other.users) == 1:
            _fold_in_place(gm.graph, add, scatter, other)
        elif padding is not None and _static(other, *_scatter_inputs(scatter)):
            _fold_padded(gm.graph, scatter, other, padding, ctx.decompositions)
        else:
            _fold_unpadded(gm.graph, add, scatter, other)
        zeros = scatter.args[0]
        gm.graph.erase_node(scatter)
        gm.graph.erase_node(zeros)
        folded += 1
    if not folded:
        log.debug("fold_scatter_grads: %s adds no scatter into zeros; graph unchanged", ctx.label)
        return gm
    log.debug("fold_scatter_grads: %s: %d scatters added into the gradient they were summed with", ctx.label, folded)
    return finish(gm)


def scatter_rows_padded(other: Tensor, mask: Tensor, index: Tensor, rows: Tensor, pad: int) -> Tensor:
    """`other` flattened and zero-padded by `pad` elements, plus `rows` scattered into it as
    aten._unsafe_masked_index_put_accumulate(other, mask, [index], rows) would add them."""
    vocab, width = other.shape
    row, values = masked_rows(vocab, mask, index, rows)
    if pad % width == 0:  # whole rows (the shards are cut by rows): index rows, not elements
        padded = F.pad(other, (0, 0, 0, pad // width))
        return padded.index_put((row,), values, accumulate=True).view(-1)
    at = row.unsqueeze(-1) * width + torch.arange(width, device=other.device)
    return F.pad(other.reshape(-1), (0, pad)).index_put((at,), values, accumulate=True)


def _fold_padded(
    graph: fx.Graph, scatter: fx.Node, other: fx.Node, padding: tuple[fx.Node, fx.Node, int], decompositions: dict
) -> None:
    view, padded, pad = padding
    fn = functools.partial(scatter_rows_padded, pad=pad)
    with graph.inserting_before(padded):
        flat = inline_traced(graph, fn, [other, *_scatter_inputs(scatter)], decompositions)
    replace_node(padded, flat)
    add = view.args[0]
    graph.erase_node(view)
    graph.erase_node(add)


def _fold_in_place(graph: fx.Graph, add: fx.Node, scatter: fx.Node, other: fx.Node) -> None:
    with graph.inserting_before(add):
        insert_call(graph, zpp.add_rows.default, other, *_scatter_inputs(scatter))
    replace_node(add, other)


def _fold_unpadded(graph: fx.Graph, add: fx.Node, scatter: fx.Node, other: fx.Node) -> None:
    with graph.inserting_before(add):
        summed = insert_call(graph, _SCATTER, other, *scatter.args[1:])
    summed.meta.update({k: v for k, v in add.meta.items() if k not in ("val", "tensor_meta")})
    replace_node(add, summed)


def _static(*nodes: fx.Node) -> bool:
    """No SymInt in the values' geometry: the padded form is traced torch code (trace_cache)."""
    return all(has_static_geometry(tensor_val(n)) for n in nodes)


def _scatter_inputs(scatter: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(mask, index, rows) of a masked scatter."""
    _, mask, (index,), rows = scatter.args
    return mask, index, rows


def _scatter_operand(add: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(the scatter into zeros, the other operand) when `add` sums one with a same-shaped tensor."""
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    for scatter, other in (add.args, tuple(reversed(add.args))):
        if _is_scatter_into_zeros(scatter) and isinstance(other, fx.Node) and _same_geometry(other, scatter, add):
            return scatter, other
    return None


def _is_scatter_into_zeros(node: object) -> bool:
    if not (isinstance(node, fx.Node) and node.target is _SCATTER and len(node.users) == 1):
        return False
    zeros, mask, indices, rows = node.args
    if not (len(indices) == 1 and isinstance(indices[0], fx.Node) and tensor_val(zeros).dim() == 2):
        return False
    index_shape = tuple(tensor_val(indices[0]).shape)
    width = tensor_val(zeros).shape[1]
    return (
        tuple(tensor_val(rows).shape) == (*index_shape, width)
        and zeros.target is aten.full.default
        and zeros.args[1] == 0
        and len(zeros.users) == 1
    )


def _same_geometry(other: fx.Node, scatter: fx.Node, add: fx.Node) -> bool:
    """Same shape, strides and dtype: the scatter into `other` then has the sum's layout."""
    vals = [tensor_val(n) for n in (other, scatter, add)]
    return all(v.shape == vals[0].shape and v.stride() == vals[0].stride() and v.dtype == vals[0].dtype for v in vals)


def _padding_of(add: fx.Node) -> Optional[tuple[fx.Node, fx.Node, int]]:
    """(view, pad node, pad) when the sum's only reader flattens it for a zero-padded reduction."""
    # The inverse of graph_utils.flatten_padded, which lower_reduce builds.
    (view,) = add.users if len(add.users) == 1 else (None,)
    if view is None or not is_call(view, aten.view.default) or list(view.args[1]) != [-1] or len(view.users) != 1:
        return None
    (padded,) = view.users
    pad = zero_pad_at_end(padded)
    return None if pad is None else (view, padded, pad)
