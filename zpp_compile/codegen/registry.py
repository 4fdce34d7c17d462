"""Which quantization kernels a device gets: the one place that decides.

  * "triton": the hand-written kernels in triton_quantize.py (qwZ int8) and triton_int4.py (qgZ
    int4), for CUDA when Triton imports.
  * "inductor": the plain torch code in quantize.py and int4.py, traced into the graph; Inductor
    generates the kernels (C++/OpenMP on CPU, its own Triton on a GPU without the hand-written ones).

Both write and read the same payloads, so ranks may even mix them. The environment variable
ZPP_QUANT_KERNELS=inductor|triton overrides the choice (for debugging, and for the tests that run
the Triton kernels in the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional

import torch
from torch import Tensor

from . import int4, quantize

QuantizePacked = Callable[[Tensor, int], Tensor]
DequantizePacked = Callable[[Tensor, int, int, int, torch.dtype], Tensor]
WithError = tuple[Tensor, Optional[Tensor]]
Int4QuantizeSwizzled = Callable[[Tensor, int, Optional[Tensor]], WithError]
Int4DequantizeReduceRequantize = Callable[[Tensor, int, int, Optional[Tensor]], WithError]
Int4DequantizeReduce = Callable[[Tensor, int, int], Tensor]

KERNEL_SETS = ("inductor", "triton")


@dataclasses.dataclass(frozen=True)
class QuantKernels:
    """qwZ's two int8 kernels (shard -> packed payload; all ranks' payloads -> full flat weight)
    and qgZ's three int4 stage kernels (see int4.py)."""

    # The name says which functions the set holds: it alone is the repr, which keys traces
    # (passes/trace_cache.py; a function's repr carries its address).
    name: str
    quantize_packed: QuantizePacked = dataclasses.field(repr=False)
    dequantize_packed: DequantizePacked = dataclasses.field(repr=False)
    int4_quantize_swizzled: Int4QuantizeSwizzled = dataclasses.field(repr=False)
    int4_dequantize_reduce_requantize: Int4DequantizeReduceRequantize = dataclasses.field(repr=False)
    int4_dequantize_reduce: Int4DequantizeReduce = dataclasses.field(repr=False)


def quant_kernels(device: torch.device | str) -> QuantKernels:
    """The kernels for tensors on `device` (see the module docstring for the rule)."""
    forced = os.environ.get("ZPP_QUANT_KERNELS")
    if forced:
        if forced not in KERNEL_SETS:
            raise ValueError(f"ZPP_QUANT_KERNELS={forced!r} is not a kernel set; use one of {KERNEL_SETS}.")
        return kernel_set(forced)
    if torch.device(device).type == "cuda" and triton_available():
        return kernel_set("triton")
    return kernel_set("inductor")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def kernel_set(name: str) -> QuantKernels:
    """The kernel set called `name` ("inductor" or "triton"), whatever the device."""
    if name == "inductor":
        return QuantKernels(
            name, quantize.quantize_packed, quantize.dequantize_packed,
            int4.quantize_int4_swizzled, int4.dequantize_reduce_requantize, int4.dequantize_reduce,
        )  # fmt: skip
    if not triton_available():
        raise RuntimeError("ZPP_QUANT_KERNELS=triton needs Triton: pip install 'zpp_compile[gpu]'.")
    from . import triton_int4, triton_quantize  # noqa: F401  (register the zpp::triton_* ops)

    ops = torch.ops.zpp
    return QuantKernels(
        name, ops.triton_quantize_packed, ops.triton_dequantize_packed,
        _error_or_none(ops.triton_int4_quantize_swizzled),
        _error_or_none(ops.triton_int4_dequantize_reduce_requantize),
        ops.triton_int4_dequantize_reduce,
    )  # fmt: skip


def _error_or_none(op: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., WithError]:
    """The Triton ops return an empty error tensor without a residual; the reference returns None."""

    def call(*args: object) -> WithError:
        payload, error = op(*args)
        return payload, (error if args[-1] is not None else None)

    call.__name__ = op.__name__
    return call
