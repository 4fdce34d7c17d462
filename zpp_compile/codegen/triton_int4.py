"""qgZ's GPU kernels in Triton: the three stages of the int4 all-to-all reduce-scatter.

    quantize_swizzled              [N, L, chunk] values -> [L, N, payload]: each chunk quantized
                                   straight into the send buffer, in the order the all-to-all needs
    dequantize_reduce_requantize   [G, R, payload] -> [R, payload]: the G received versions of each
                                   chunk decoded, summed in fp32 and re-quantized, in one pass
    dequantize_reduce              [G, R, payload] -> [R, chunk] fp32 sums (the last stage)

Same maths and wire layout as int4.py (the reference): q + 8 in a nibble, two per byte, then one
fp32 scale per block. A program handles ROWS blocks of one chunk as two [ROWS, HALF_P2] tiles
(even and odd elements, i.e. low and high nibbles), so no tile reshapes are needed. Sums run over
the G senders in order, as in the reference. With error feedback (`residual`), the residual is
added before quantizing and the new error is written by the same kernel.

In Triton's interpreter (the tests, on CPU) the kernels match int4.py bit for bit. Compiled for a
GPU, Triton may contract "acc + q * scale" into one fused multiply-add, so a sum can differ from
the reference in its last bit; the payloads then decode within the same int4 bound.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .int4 import OFFSET as _OFFSET
from .int4 import QMAX as _QMAX
from .int4 import chunk_payload_numel
from .triton_quantize import block_scales, quantize_to_grid, tiling

# Compiled Triton reads a module global in a kernel only if it is a tl.constexpr (the
# interpreter, which the CPU tests use, does not check: found on a GPU).
QMAX = tl.constexpr(_QMAX)
OFFSET = tl.constexpr(_OFFSET)


@triton.jit
def _quantize_store(
    lo, hi, rows, halves, keep, residual_row, payload_row, error_row, n_blocks,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Quantize ROWS blocks given as their even (lo) and odd (hi) elements; store bytes and scales.
    With a residual (error feedback), add it first and store the new error too."""
    if HAS_RESIDUAL:
        res_lo, res_hi = _load_pairs(residual_row, rows, halves, keep, BLOCK)
        lo += res_lo
        hi += res_hi
    absmax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    has_nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0
    divisor, stored_scale = block_scales(absmax, has_nan, QMAX)
    q_lo = quantize_to_grid(lo, divisor, QMAX)
    q_hi = quantize_to_grid(hi, divisor, QMAX)
    byte = (q_lo + OFFSET).to(tl.uint8) | ((q_hi + OFFSET).to(tl.uint8) << 4)
    tl.store(payload_row + rows[:, None] * (BLOCK // 2) + halves[None, :], byte, mask=keep)
    scale_ptr = (payload_row + n_blocks * (BLOCK // 2)).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr + rows, stored_scale, mask=rows < n_blocks)
    if HAS_RESIDUAL:
        even = rows[:, None] * BLOCK + 2 * halves[None, :]
        tl.store(error_row + even, lo - q_lo * stored_scale[:, None], mask=keep)
        tl.store(error_row + even + 1, hi - q_hi * stored_scale[:, None], mask=keep)


@triton.jit
def _load_pairs(row_ptr, rows, halves, keep, BLOCK: tl.constexpr):
    """The even and odd elements of ROWS blocks of one chunk, as float32."""
    even = rows[:, None] * BLOCK + 2 * halves[None, :]
    lo = tl.load(row_ptr + even, mask=keep, other=0.0).to(tl.float32)
    hi = tl.load(row_ptr + even + 1, mask=keep, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _quantize_swizzled_kernel(
    values_ptr, residual_ptr, payload_ptr, error_ptr, nodes, local, chunk, n_blocks, payload_numel,
    BLOCK: tl.constexpr, HALF_P2: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    out_row = tl.program_id(1)  # = l * nodes + n, reading values row n * local + l
    source_row = (out_row % nodes) * local + out_row // nodes
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    halves = tl.arange(0, HALF_P2)
    keep = (rows[:, None] < n_blocks) & (halves[None, :] < BLOCK // 2)
    lo, hi = _load_pairs(values_ptr + source_row * chunk, rows, halves, keep, BLOCK)
    _quantize_store(
        lo, hi, rows, halves, keep, residual_ptr + out_row * chunk, payload_ptr + out_row * payload_numel,
        error_ptr + out_row * chunk, n_blocks, BLOCK=BLOCK, HAS_RESIDUAL=HAS_RESIDUAL,
    )  # fmt: skip


@triton.jit
def _dequantize_pairs(payload_row, rows, halves, keep, n_blocks, BLOCK: tl.constexpr):
    byte = tl.load(payload_row + rows[:, None] * (BLOCK // 2) + halves[None, :], mask=keep, other=0)
    scale_ptr = (payload_row + n_blocks * (BLOCK // 2)).to(tl.pointer_type(tl.float32), bitcast=True)
    scale = tl.load(scale_ptr + rows, mask=rows < n_blocks, other=0.0)[:, None]
    lo = ((byte & 0xF).to(tl.float32) - OFFSET) * scale
    hi = ((byte >> 4).to(tl.float32) - OFFSET) * scale
    return tl.where(keep, lo, 0.0), tl.where(keep, hi, 0.0)  # lanes past the block must not count in absmax


@triton.jit
def _dequantize_reduce_kernel(
    payloads_ptr, residual_ptr, out_ptr, error_ptr, senders, chunk_rows, chunk, n_blocks, payload_numel,
    BLOCK: tl.constexpr, HALF_P2: tl.constexpr, ROWS: tl.constexpr,
    REQUANTIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    halves = tl.arange(0, HALF_P2)
    keep = (rows[:, None] < n_blocks) & (halves[None, :] < BLOCK // 2)
    lo, hi = _dequantize_pairs(payloads_ptr + row * payload_numel, rows, halves, keep, n_blocks, BLOCK)
    for sender in range(1, senders):  # in order, as the reference sums
        payload_row = payloads_ptr + (sender * chunk_rows + row) * payload_numel
        next_lo, next_hi = _dequantize_pairs(payload_row, rows, halves, keep, n_blocks, BLOCK)
        lo += next_lo
        hi += next_hi
    if REQUANTIZE:
        _quantize_store(
            lo, hi, rows, halves, keep, residual_ptr + row * chunk, out_ptr + row * payload_numel,
            error_ptr + row * chunk, n_blocks, BLOCK=BLOCK, HAS_RESIDUAL=HAS_RESIDUAL,
        )  # fmt: skip
    else:
        even = rows[:, None] * BLOCK + 2 * halves[None, :]
        tl.store(out_ptr + row * chunk + even, lo, mask=keep)
        tl.store(out_ptr + row * chunk + even + 1, hi, mask=keep)


def _residual_and_error(residual: Optional[Tensor], rows: int, chunk: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(residual as float32 rows, the error buffer): both empty placeholders without feedback."""
    if residual is None:
        empty = like.new_empty(0, dtype=torch.float32)
        return empty, empty
    return residual.reshape(rows, chunk).float().contiguous(), like.new_empty(rows, chunk, dtype=torch.float32)


@triton_op("zpp::triton_int4_quantize_swizzled", mutates_args=())
def quantize_swizzled(values: Tensor, block: int, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """[N, L, chunk] -> ([L, N, payload] uint8, error [L, N, chunk] fp32; empty without residual)."""
    nodes, local, chunk = values.shape
    n_blocks, payload = chunk // block, chunk_payload_numel(chunk, block)
    residual, error = _residual_and_error(residual, local * nodes, chunk, values)
    out = values.new_empty(local, nodes, payload, dtype=torch.uint8)
    half_p2, rows = tiling(block // 2, tiles=2)  # even and odd elements
    wrap_triton(_quantize_swizzled_kernel)[(triton.cdiv(n_blocks, rows), nodes * local)](
        values.contiguous(), residual, out, error, nodes, local, chunk, n_blocks, payload,
        BLOCK=block, HALF_P2=half_p2, ROWS=rows, HAS_RESIDUAL=residual.numel() > 0,
    )  # fmt: skip
    return out, error.view(local, nodes, chunk) if error.numel() else error


@triton_op("zpp::triton_int4_dequantize_reduce_requantize", mutates_args=())
def dequantize_reduce_requantize(
    payloads: Tensor, chunk: int, block: int, residual: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """[G, R, payload] -> ([R, payload] uint8 of the sums, error [R, chunk] fp32; empty without residual)."""
    senders, chunk_rows, payload = payloads.shape
    residual, error = _residual_and_error(residual, chunk_rows, chunk, payloads)
    out = payloads.new_empty(chunk_rows, payload)
    _launch_reduce(payloads, residual, out, error, chunk, block, requantize=True)
    return out, error


@triton_op("zpp::triton_int4_dequantize_reduce", mutates_args=())
def dequantize_reduce(payloads: Tensor, chunk: int, block: int) -> Tensor:
    """[G, R, payload] -> [R, chunk] float32 sums over the G senders."""
    senders, chunk_rows, payload = payloads.shape
    empty = payloads.new_empty(0, dtype=torch.float32)
    out = payloads.new_empty(chunk_rows, chunk, dtype=torch.float32)
    _launch_reduce(payloads, empty, out, empty, chunk, block, requantize=False)
    return out


def _launch_reduce(
    payloads: Tensor, residual: Tensor, out: Tensor, error: Tensor, chunk: int, block: int, *, requantize: bool
) -> None:
    senders, chunk_rows, payload = payloads.shape
    n_blocks = chunk // block
    half_p2, rows = tiling(block // 2, tiles=2)  # even and odd elements
    wrap_triton(_dequantize_reduce_kernel)[(triton.cdiv(n_blocks, rows), chunk_rows)](
        payloads.contiguous(), residual, out, error, senders, chunk_rows, chunk, n_blocks, payload,
        BLOCK=block, HALF_P2=half_p2, ROWS=rows, REQUANTIZE=requantize, HAS_RESIDUAL=residual.numel() > 0,
    )  # fmt: skip
