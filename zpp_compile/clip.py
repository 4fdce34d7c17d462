"""Gradient clipping by the global norm, with torch's signature, returning a plain tensor.

torch.nn.utils.clip_grad_norm_ already clips zpp_compile's parameters by the global norm: their
gradients are DTensors, whose norms DTensor reduces across ranks (one all-reduce for the whole
model), so the usual training-loop call needs no change. It returns the total norm as a DTensor,
as it does for FSDP2. These functions are the same computation for code that wants a plain tensor
back (for logging, or to compare with a threshold), equal on every rank. Collective: every rank
calls them.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

_Tensors = Union[Tensor, Iterable[Tensor]]


def get_total_norm(
    tensors: _Tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None
) -> Tensor:
    """The norm of all `tensors` together (global across ranks for sharded ones), as
    torch.nn.utils.get_total_norm computes it, as a plain tensor on every rank."""
    total = torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm_(
    parameters: _Tensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> Tensor:
    """Clip the gradients of `parameters` so that their global norm is at most `max_norm`, as
    torch.nn.utils.clip_grad_norm_ does; return the global norm before clipping, a plain tensor.

    Tied parameters count once (pass model.parameters(), which yields each once); parameters
    without a gradient (frozen) are skipped; padding never counts (DTensor chunks hold none).
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
