"""Which quantization kernels a device gets: the one place that decides.

  * "triton": the hand-written kernels in triton_quantize.py (CUDA, when Triton imports).
  * "inductor": the plain torch code in quantize.py, traced into the graph; Inductor generates the
    kernels (C++/OpenMP on CPU, its own Triton on a GPU without the hand-written ones).

Both write and read the same packed payload, so ranks may even mix them. The environment variable
ZPP_QUANT_KERNELS=inductor|triton overrides the choice (for debugging, and for the tests that run
the Triton kernels in the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import torch
from torch import Tensor

from . import quantize

QuantizePacked = Callable[[Tensor, int], Tensor]
DequantizePacked = Callable[[Tensor, int, int, int, torch.dtype], Tensor]

KERNEL_SETS = ("inductor", "triton")


@dataclasses.dataclass(frozen=True)
class QuantKernels:
    """qwZ's two kernels: shard -> packed payload, and all ranks' payloads -> full flat weight."""

    name: str
    quantize_packed: QuantizePacked
    dequantize_packed: DequantizePacked


def quant_kernels(device: torch.device | str) -> QuantKernels:
    """The kernels for tensors on `device` (see the module docstring for the rule)."""
    forced = os.environ.get("ZPP_QUANT_KERNELS")
    if forced:
        if forced not in KERNEL_SETS:
            raise ValueError(f"ZPP_QUANT_KERNELS={forced!r} is not a kernel set; use one of {KERNEL_SETS}.")
        return _kernel_set(forced)
    if torch.device(device).type == "cuda" and triton_available():
        return _kernel_set("triton")
    return _kernel_set("inductor")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel_set(name: str) -> QuantKernels:
    if name == "inductor":
        return QuantKernels(name, quantize.quantize_packed, quantize.dequantize_packed)
    if not triton_available():
        raise RuntimeError("ZPP_QUANT_KERNELS=triton needs Triton: pip install 'zpp_compile[gpu]'.")
    from . import triton_quantize  # registers the zpp::triton_* ops

    return QuantKernels(name, torch.ops.zpp.triton_quantize_packed, torch.ops.zpp.triton_dequantize_packed)
