"""zpp::add_rows: an embedding's gradient rows added into a gradient in place.

A tied weight's two gradients (the LM head's, a whole-weight matmul result, and the embedding's,
a few rows per token) are summed before their reduction. Functional graphs sum into a new
whole-weight buffer; passes/fold_scatter_grads.py writes the rows into the head's gradient itself
where that gradient is a buffer only the sum reads. In a graph compiled by region the head's
gradient is an input of the last region, which Inductor never overwrites: this op runs between
regions (inductor_regions.BOUNDARY_OPS), as the collectives do, so the write stays in place.

    zpp.add_rows(grad, mask, index, rows)   # grad[index] += rows where mask, as
                                            # aten._unsafe_masked_index_put_accumulate adds them
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("zpp::add_rows", mutates_args=("grad",))
def add_rows(grad: Tensor, mask: Tensor, index: Tensor, rows: Tensor) -> None:
    """grad (V x C) += rows (index's shape x C) at row index, where mask; rows repeated in index
    are added one at a time."""
    row, values = masked_rows(grad.shape[0], mask, index, rows)
    grad.index_put_((row,), values, accumulate=True)


@add_rows.register_fake
def _(grad: Tensor, mask: Tensor, index: Tensor, rows: Tensor) -> None:
    return None


def masked_rows(vocab: int, mask: Tensor, index: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """(row, values) that index_put(..., accumulate=True) adds as the masked scatter does: indices
    clamped to [-vocab, vocab - 1], negative ones counted from the end; masked rows add zero."""
    row = index.clamp(-vocab, vocab - 1)
    row = torch.where(row < 0, row + vocab, row)
    return row, torch.where(mask, rows, 0)
