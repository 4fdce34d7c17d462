"""Symmetric per-block int8 quantization for qwZ's forward all-gather (plain torch ops).

Written as ordinary ATen-level torch code so that the qwZ pass can trace it into the graph, where
Inductor turns it into fused C++/OpenMP kernels on CPU (the same code runs eagerly for tests).

What one rank sends is one packed int8 payload, and one all-gather carries it:
    [ q: n_blocks * block int8 | scales: n_blocks float32, bit-cast to 4 * n_blocks int8 ]
block is a multiple of 8, so every rank's scales start 4-byte aligned in the gathered buffer.
They are read back by float32_from_bytes, which Inductor fuses into the dequantize kernel. The
Triton kernels (triton_quantize.py) write and read exactly this layout.

Inductor 2.13 on CPU miscompiles "int8 * scale, reshape, slice each row, flatten" (values of
1e18 came out, even without collectives); dequantize_packed therefore drops each rank's
padding, and the padding past the weight's end, with an index gather instead of a slice.

Special values, by design:
  * an all-zero block has scale 0 and dequantizes to exact zeros (no division by zero);
  * tiny values are scaled by their own block's absmax, so they keep ~7 bits of precision;
  * a block holding inf or nan gets a nan scale, so the whole block dequantizes to nan: a broken
    weight stays visibly broken instead of being turned into finite numbers.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# Where each byte of a float32, least significant first, sits in memory (a bit-cast writes them).
_BYTE_ORDER_LOW_FIRST = (0, 1, 2, 3) if sys.byteorder == "little" else (3, 2, 1, 0)
QMAX = 127  # symmetric int8: [-127, 127], so -x quantizes to -q
SCALE_BYTES = 4


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), exact at any size."""
    return -(-a // b)


def num_blocks(numel: int, block: int) -> int:
    return ceil_div(numel, block)


def payload_numel(numel: int, block: int) -> int:
    """Bytes one rank sends for a shard of `numel` elements: int8 blocks plus a float32 per block."""
    nb = num_blocks(numel, block)
    return nb * block + nb * SCALE_BYTES


def quantize_int8_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x (any float dtype, any shape) -> (q int8 [n_blocks, block], scale float32 [n_blocks])."""
    flat = x.reshape(-1).float()
    nb = num_blocks(flat.numel(), block)
    q, scale = round_symmetric(F.pad(flat, (0, nb * block - flat.numel())).view(nb, block), QMAX)
    return q.to(torch.int8), scale


def round_symmetric(blocks: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """[..., block] float32 -> (q in [-qmax, qmax] as float32 [..., block], scale [...]).

    Shared by int8 (qwZ) and int4 (qgZ); the special values of the module docstring live here.
    """
    absmax = blocks.abs().amax(dim=-1)  # nan propagates, inf stays inf
    scale = absmax / qmax
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero (or nan) blocks: divide by 1
    scaled = blocks / divisor.unsqueeze(-1)
    scaled = torch.where(scaled != scaled, 0.0, scaled)  # nan -> 0 (not nan_to_num: its isnan is not vectorized)
    q = torch.clamp(torch.round(scaled), -qmax, qmax)  # +-inf -> +-qmax
    scale = torch.where(torch.isfinite(absmax), scale, torch.full_like(scale, float("nan")))
    return q, scale


def dequantize_int8_blocks(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """(q [..., n_blocks, block], scale [..., n_blocks]) -> values [..., n_blocks * block] in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype).flatten(-2)


def pack_payload(q: Tensor, scale: Tensor) -> Tensor:
    """(q int8 [n_blocks, block], scale float32 [n_blocks]) -> one int8 payload (layout above)."""
    return torch.cat([q.reshape(-1), scale.view(torch.int8)])


def unpack_payloads(
    payloads: Tensor, group_size: int, shard_numel: int, block: int, senders: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """All ranks' payloads, concatenated -> (q [senders, per, n_blocks, block], scale [senders, per,
    n_blocks]): the output of a gather over `senders` ranks (group_size by default), each of which
    sent per = group_size / senders payloads back to back (hpZ's secondary).

    Indexed by (sender, payload of the sender), not by a flat payload number: in a bucketed gather
    the payloads are a slice of each sender's row, so a flat number n would read the bucket at
    row (P*n + c) // (per*P), floor divisions that Inductor's C++ code generation takes ~15 ms
    each to analyse (docs/compile_time.md); (sender, payload) reads it affinely."""
    senders = group_size if senders is None else senders
    if group_size % senders:
        raise ValueError(f"{group_size} payloads cannot come from {senders} senders in equal parts")
    nb = num_blocks(shard_numel, block)
    rows = payloads.view(senders, group_size // senders, payload_numel(shard_numel, block))
    q = rows[..., : nb * block].unflatten(-1, (nb, block))
    return q, float32_from_bytes(rows[..., nb * block :])


def float32_from_bytes(raw: Tensor) -> Tensor:
    """[..., 4 * k] int8/uint8 bytes (float32s as a bit-cast wrote them, any strides) -> [..., k] float32.

    The same bits as `raw.contiguous().view(torch.float32)`, but assembled with integer arithmetic
    and a same-width bit-cast, which Inductor fuses into the kernel that reads the scales. A
    bit-cast to a wider dtype is not fusable: Inductor makes the bytes contiguous first, one copy
    kernel per parameter (its offset in the gathered buffer is baked in), each a C++ compile of
    its own: 21 of the 98 kernels of a 6-layer GPT-2 under qwZ + hpZ + qgZ."""
    low, mid_low, mid_high, high = _BYTE_ORDER_LOW_FIRST
    per_float = raw.unflatten(-1, (-1, SCALE_BYTES))
    b = per_float.view(torch.uint8).to(torch.int32)
    top = per_float.view(torch.int8)[..., high].to(torch.int32)
    # The top byte signed and multiplied, not shifted: the sum stays within int32 (no overflow,
    # no shift into the sign bit) and is the float's bit pattern read as an int32.
    bits = top * (1 << 24) + b[..., mid_high] * (1 << 16) + b[..., mid_low] * (1 << 8) + b[..., low]
    return bits.view(torch.float32)


def quantize_packed(shard: Tensor, block: int) -> Tensor:
    """A shard -> its packed int8 payload."""
    return pack_payload(*quantize_int8_blocks(shard, block))


def dequantize_packed(
    payloads: Tensor,
    group_size: int,
    shard_numel: int,
    block: int,
    dtype: torch.dtype,
    numel: Optional[int] = None,
    senders: Optional[int] = None,
) -> Tensor:
    """All ranks' payloads, concatenated -> the flat full tensor in `dtype`: its first `numel`
    elements (all group_size * shard_numel by default). `senders`: see unpack_payloads."""
    nb = num_blocks(shard_numel, block)
    q, scale = unpack_payloads(payloads, group_size, shard_numel, block, senders)
    total = group_size * shard_numel if numel is None else numel
    if nb * block == shard_numel and total == group_size * shard_numel:
        return dequantize_int8_blocks(q, scale, dtype).reshape(-1)
    # Padding inside a rank's blocks or past the weight's end: each element read from its rank's
    # payload by index (see the module docstring), so only the weight is written. Dequantizing the
    # padded whole and slicing it made Inductor write both, the padded buffer unread (2 x 147 MB
    # and 2.3x the time for GPT-2's embedding on 4 ranks).
    per_sender = q.shape[1]
    i = torch.arange(total, device=payloads.device)
    rank, within = i // shard_numel, i % shard_numel
    sender, slot = rank // per_sender, rank % per_sender
    q_rows = q.flatten(-2)
    return (q_rows[sender, slot, within].float() * scale[sender, slot, within // block]).to(dtype)


def weight_from_payloads(
    gathered: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    block: int,
    dtype: torch.dtype,
    dequantize: Callable[[Tensor, int, int, int, torch.dtype], Tensor] = dequantize_packed,
    senders: Optional[int] = None,
) -> Tensor:
    """Gathered payloads (each for `shard_numel` values) -> the full weight: unpadded, shaped.
    `senders`: how many ranks the gather had (see unpack_payloads); one payload each by default."""
    n_payloads = gathered.numel() // payload_numel(shard_numel, block)
    if dequantize is dequantize_packed:  # torch code: the weight alone, not a padded whole sliced
        return dequantize_packed(gathered, n_payloads, shard_numel, block, dtype, numel, senders).view(shape)
    return dequantize(gathered, n_payloads, shard_numel, block, dtype)[:numel].view(shape)
