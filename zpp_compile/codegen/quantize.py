"""Symmetric per-block int8 quantization for qwZ's forward all-gather (plain torch ops).

Written as ordinary ATen-level torch code so that the qwZ pass can trace it into the graph, where
Inductor turns it into fused C++/OpenMP kernels on CPU (the same code runs eagerly for tests).

What one rank sends: q (n_blocks * block int8) and its scales (n_blocks float32), as two
all-gathers issued back to back. One packed int8 buffer (scales bit-cast into it) is the goal and
is not done yet.

Inductor 2.13 on CPU miscompiles "int8 * scale, reshape, slice each row, flatten" (values of
1e18 came out, even without collectives); dequantize_gathered therefore drops each rank's
padding with an index gather instead of a row slice.

Special values, by design:
  * an all-zero block has scale 0 and dequantizes to exact zeros (no division by zero);
  * tiny values are scaled by their own block's absmax, so they keep ~7 bits of precision;
  * a block holding inf or nan gets a nan scale, so the whole block dequantizes to nan: a broken
    weight stays visibly broken instead of being turned into finite numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

QMAX = 127  # symmetric int8: [-127, 127], so -x quantizes to -q
SCALE_BYTES = 4


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def payload_numel(numel: int, block: int) -> int:
    """Bytes one rank sends for a shard of `numel` elements: int8 blocks plus a float32 per block."""
    nb = num_blocks(numel, block)
    return nb * block + nb * SCALE_BYTES


def quantize_int8_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x (any float dtype, any shape) -> (q int8 [n_blocks, block], scale float32 [n_blocks])."""
    flat = x.reshape(-1).float()
    nb = num_blocks(flat.numel(), block)
    blocks = F.pad(flat, (0, nb * block - flat.numel())).view(nb, block)
    absmax = blocks.abs().amax(dim=1)  # nan propagates, inf stays inf
    scale = absmax / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero (or nan) blocks: divide by 1
    scaled = torch.nan_to_num(blocks / divisor[:, None], nan=0.0, posinf=QMAX, neginf=-QMAX)
    q = torch.clamp(torch.round(scaled), -QMAX, QMAX).to(torch.int8)
    scale = torch.where(torch.isfinite(absmax), scale, torch.full_like(scale, float("nan")))
    return q, scale


def dequantize_int8_blocks(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """(q [..., n_blocks, block], scale [..., n_blocks]) -> values [..., n_blocks * block] in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype).flatten(-2)


def dequantize_gathered(
    q_all: Tensor, scale_all: Tensor, group_size: int, shard_numel: int, block: int, dtype: torch.dtype
) -> Tensor:
    """All ranks' blocks and scales, concatenated -> the flat full tensor (shard_numel * group_size)."""
    nb = num_blocks(shard_numel, block)
    values = dequantize_int8_blocks(q_all.view(group_size, nb, block), scale_all.view(group_size, nb), dtype)
    values = values.reshape(-1)
    if nb * block == shard_numel:
        return values
    i = torch.arange(group_size * shard_numel, device=values.device)
    return values[(i // shard_numel) * (nb * block) + i % shard_numel]  # see the module docstring


def quantized_all_gather(
    shard: Tensor, numel: int, shape: list[int], group_size: int, group_name: str, block: int
) -> Tensor:
    """qwZ's forward gather: quantize, all-gather data and scales, dequantize to the shard's dtype."""
    c10d = torch.ops._c10d_functional
    q, scale = quantize_int8_blocks(shard, block)
    q_all = c10d.all_gather_into_tensor(q.reshape(-1), group_size, group_name)
    scale_all = c10d.all_gather_into_tensor(scale, group_size, group_name)
    full = dequantize_gathered(
        c10d.wait_tensor(q_all), c10d.wait_tensor(scale_all), group_size, shard.numel(), block, shard.dtype
    )
    return full[:numel].view(shape)
