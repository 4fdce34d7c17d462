"""qwZ's GPU kernels in Triton: quantize a shard into its packed payload, dequantize gathered payloads.

Same maths and the same wire layout as quantize.py (the reference), so CPU and GPU ranks agree
bit for bit on what travels:
    [ q: n_blocks * block int8 | scales: n_blocks float32, bit-cast ]
Each program handles ROWS blocks as a [ROWS, BLOCK_P2] tile (BLOCK_P2: block rounded up to a
power of two, the lanes past `block` masked off), so any block size that is a multiple of 8 works.

The kernels are registered with torch.library.triton_op and launched through wrap_triton, so
under torch.compile Inductor sees user-defined Triton kernels it can schedule (not opaque Python).
With TRITON_INTERPRET=1 they run on CPU tensors; the tests check them that way against quantize.py.

Special values follow quantize.py: an all-zero block has scale 0 (no division by zero); a block
holding nan or inf gets a nan scale, so all of it dequantizes to nan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .quantize import QMAX as _QMAX
from .quantize import num_blocks, payload_numel

# Compiled Triton reads a module global in a kernel only if it is a tl.constexpr (the
# interpreter, which the CPU tests use, does not check: found on a GPU).
QMAX = tl.constexpr(_QMAX)
_TILE_ELEMENTS = 4096  # elements per program: enough work per program, few registers per thread


@triton.jit
def _round_half_to_even(v):
    """torch.round's rounding, spelled out so that it means the same on every Triton backend."""
    down = tl.floor(v)
    frac = v - down  # exact for |v| <= 127
    is_odd = (down - 2.0 * tl.floor(down * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    return down + up.to(tl.float32)


@triton.jit
def _bfloat16_round_to_nearest_even(v):
    """fp32 -> bf16 with torch's rounding, by bits: Triton's interpreter truncates instead."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded).to(tl.bfloat16)  # a nan's payload could carry into the sign


@triton.jit
def block_scales(absmax, has_nan, qmax: tl.constexpr):
    """Per-block (divisor, stored scale) from the blocks' absmax, as quantize.round_symmetric."""
    scale = tl.div_rn(absmax, tl.full(absmax.shape, qmax, tl.float32))  # IEEE, as torch: `/` is approximate on GPU
    divisor = tl.where((scale > 0) & ~has_nan, scale, 1.0)  # zero and nan blocks divide by 1
    finite = (absmax < float("inf")) & ~has_nan
    return divisor, tl.where(finite, scale, float("nan"))


@triton.jit
def quantize_to_grid(x, divisor, qmax: tl.constexpr):
    """x / divisor rounded to an integer in [-qmax, qmax] (as float32); nan -> 0."""
    scaled = tl.div_rn(x, divisor[:, None])
    scaled = tl.where(scaled != scaled, 0.0, scaled)
    return _round_half_to_even(tl.minimum(tl.maximum(scaled, -qmax), qmax))


@triton.jit
def _quantize_pack_kernel(
    x_ptr, payload_ptr, numel, n_blocks, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P2)
    offsets = rows[:, None] * BLOCK + cols[None, :]
    in_block = (rows[:, None] < n_blocks) & (cols[None, :] < BLOCK)
    x = tl.load(x_ptr + offsets, mask=in_block & (offsets < numel), other=0.0).to(tl.float32)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    divisor, stored_scale = block_scales(tl.max(tl.abs(x), axis=1), has_nan, QMAX)
    q = quantize_to_grid(x, divisor, QMAX)
    tl.store(payload_ptr + offsets, q.to(tl.int8), mask=in_block)
    scale_ptr = (payload_ptr + n_blocks * BLOCK).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr + rows, stored_scale, mask=rows < n_blocks)


@triton.jit
def _dequantize_unpack_kernel(
    payload_ptr, out_ptr, shard_numel, n_blocks, payload_numel,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rank = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P2)
    within = rows[:, None] * BLOCK + cols[None, :]  # element index inside this rank's shard
    keep = (rows[:, None] < n_blocks) & (cols[None, :] < BLOCK) & (within < shard_numel)
    rank_payload = payload_ptr + rank * payload_numel
    q = tl.load(rank_payload + within, mask=keep, other=0).to(tl.float32)
    scale_ptr = (rank_payload + n_blocks * BLOCK).to(tl.pointer_type(tl.float32), bitcast=True)
    scale = tl.load(scale_ptr + rows, mask=rows < n_blocks, other=0.0)
    values = q * scale[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        values = _bfloat16_round_to_nearest_even(values)
    tl.store(out_ptr + rank * shard_numel + within, values.to(out_ptr.dtype.element_ty), mask=keep)


def tiling(lanes: int, tiles: int = 1) -> tuple[int, int]:
    """(lanes_p2, rows): a program's tiles are [rows, lanes_p2], `lanes` rounded up to a power of two
    (the lanes past it masked off), with rows such that its `tiles` tiles hold about _TILE_ELEMENTS."""
    lanes_p2 = triton.next_power_of_2(lanes)
    return lanes_p2, max(1, _TILE_ELEMENTS // (tiles * lanes_p2))


@triton_op("zpp::triton_quantize_packed", mutates_args=())
def quantize_packed(shard: Tensor, block: int) -> Tensor:
    """A shard (fp32/bf16/fp16, any shape) -> its packed int8 payload, written by one kernel."""
    flat = shard.reshape(-1)
    n_blocks = num_blocks(flat.numel(), block)
    payload = torch.empty(payload_numel(flat.numel(), block), dtype=torch.int8, device=shard.device)
    block_p2, rows = tiling(block)
    grid = (triton.cdiv(n_blocks, rows),)
    wrap_triton(_quantize_pack_kernel)[grid](
        flat, payload, flat.numel(), n_blocks, BLOCK=block, BLOCK_P2=block_p2, ROWS=rows
    )
    return payload


@triton_op("zpp::triton_dequantize_packed", mutates_args=())
def dequantize_packed(payloads: Tensor, group_size: int, shard_numel: int, block: int, dtype: torch.dtype) -> Tensor:
    """All ranks' payloads, concatenated -> the flat full tensor (shard_numel * group_size) in `dtype`."""
    n_blocks = num_blocks(shard_numel, block)
    out = torch.empty(group_size * shard_numel, dtype=dtype, device=payloads.device)
    block_p2, rows = tiling(block)
    grid = (triton.cdiv(n_blocks, rows), group_size)
    wrap_triton(_dequantize_unpack_kernel)[grid](
        payloads, out, shard_numel, n_blocks, payload_numel(shard_numel, block),
        BLOCK=block, BLOCK_P2=block_p2, ROWS=rows,
    )  # fmt: skip
    return out
