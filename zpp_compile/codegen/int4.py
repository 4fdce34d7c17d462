"""Symmetric per-block int4 quantization for qgZ's gradient all-to-alls (plain torch ops).

Like quantize.py, this is the reference and the CPU path: the qgZ pass traces it into the backward
graph, where Inductor generates C++/OpenMP kernels for it. triton_int4.py implements the same
three stage kernels (swizzled quantize, dequantize-reduce, dequantize-reduce-requantize) for GPUs,
bit for bit.

Values are quantized to q in [-7, 7] with one fp32 scale (absmax / 7) per block of `block`
elements and stored as q + 8 in four bits, two per byte (element 2i in the low nibble, 2i+1 in the
high one). One chunk's payload is
    [ packed: n_blocks * block / 2 uint8 | scales: n_blocks float32, bit-cast to uint8 ]
so `block` must be a multiple of 8 (scales stay 4-byte aligned). Special values follow the int8
code: an all-zero block has scale 0 and gives zeros; a block with inf or nan gets a nan scale.

Sums over the ranks that sent payloads run in rank order, one addition at a time, so every kernel
set (and every rank, CPU or GPU) rounds them the same way.
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import torch
from torch import Tensor

from .quantize import SCALE_BYTES, float32_from_bytes, round_symmetric

QMAX = 7
OFFSET = 8


def chunk_payload_numel(chunk_numel: int, block: int) -> int:
    """Bytes of one chunk of `chunk_numel` values (a multiple of block) once packed."""
    n_blocks = chunk_numel // block
    return chunk_numel // 2 + SCALE_BYTES * n_blocks


def quantize_int4_chunks(chunks: Tensor, block: int) -> Tensor:
    """[..., chunk] float (chunk a multiple of block) -> [..., payload] uint8, one payload per chunk."""
    lead, chunk = chunks.shape[:-1], chunks.shape[-1]
    q, scale = round_symmetric(chunks.float().reshape(*lead, chunk // block, block), QMAX)
    q = (q + OFFSET).to(torch.uint8).reshape(*lead, chunk // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return torch.cat([packed, scale.view(torch.uint8).reshape(*lead, -1)], dim=-1)


def dequantize_int4_chunks(payloads: Tensor, chunk: int, block: int) -> Tensor:
    """[..., payload] uint8 -> [..., chunk] float32."""
    lead = payloads.shape[:-1]
    packed, scales = payloads[..., : chunk // 2], payloads[..., chunk // 2 :]
    low = (packed & 0xF).to(torch.float32) - OFFSET
    high = (packed >> 4).to(torch.float32) - OFFSET
    q = torch.stack([low, high], dim=-1).reshape(*lead, chunk // block, block)
    scale = float32_from_bytes(scales).reshape(*lead, chunk // block, 1)
    return (q * scale).reshape(*lead, chunk)


# The three stage kernels of qgZ. `residual` is error feedback: added to the values before they
# are quantized; the kernel then also returns the new error (values - what the payload decodes to).


def quantize_int4_swizzled(
    values: Tensor, block: int, residual: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """[N, L, chunk] values -> ([L, N, payload] uint8, error [L, N, chunk] or None).

    The swizzle: payload row [l, n] holds values row [n, l], so the all-to-all that sends row l to
    local rank l hands it every node's chunk for the rank it will become the owner for."""
    swizzled = values.transpose(0, 1).float()
    return _quantize_with_feedback(swizzled, block, residual)


def dequantize_reduce(payloads: Tensor, chunk: int, block: int) -> Tensor:
    """[G, R, payload] uint8 (one [R, payload] from each of G ranks) -> [R, chunk] float32 sums."""
    decoded = dequantize_int4_chunks(payloads, chunk, block)
    return functools.reduce(operator.add, decoded.unbind(0))


def dequantize_reduce_requantize(
    payloads: Tensor, chunk: int, block: int, residual: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """[G, R, payload] uint8 -> ([R, payload] uint8 of the sums, error [R, chunk] or None)."""
    return _quantize_with_feedback(dequantize_reduce(payloads, chunk, block), block, residual)


def _quantize_with_feedback(values: Tensor, block: int, residual: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    if residual is None:
        return quantize_int4_chunks(values, block), None
    values = values + residual.float()
    payload = quantize_int4_chunks(values, block)
    return payload, values - dequantize_int4_chunks(payload, values.shape[-1], block)
