"""qwz: quantized weight all-gather in the forward (ZeRO++ qwZ).

Runs on the partitioned forward (and inference) graph, before lower_gather; backward gathers are
left to lower_gather and stay full precision, as are the forward gathers of the weights that
Config.qwz_parameters leaves out.
Before:  w = zpp.gather_param(local, numel, shape, shard_numel, group_size, group_name)
After:   shard = pad(local.view(-1), shard_numel)     this rank's part as every rank sends it
         payload = quantize_packed(shard)            int8 blocks + fp32 scales in one buffer
         gathered = wait_tensor(all_gather_into_tensor(payload))      one collective
         w = dequantize_packed(gathered)[:numel].view(shape)          in the shard's dtype,
                                                                       or Config.param_dtype
The two kernels come from codegen.registry for the shard's device: on CPU plain torch code that
Inductor fuses into one C++ kernel each; on CUDA the hand-written Triton kernels, traced as
triton_kernel_wrapper_functional so that Inductor schedules them as kernels.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ..codegen.quantize import weight_from_payloads
from ..codegen.registry import QuantKernels, quant_kernels
from .context import PassContext
from .graph_utils import inline_traced, rewrite_calls, tag_collectives
from .tag_parameter_inputs import parameter_names_of

log = logging.getLogger(__name__)


def qwz(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.quantize_weights:
        log.debug("qwz: %s: Config.quantize_weights is off; graph unchanged", ctx.label)
        return gm
    rewrite = functools.partial(
        _quantized_gather, block=ctx.config.weight_block_size, decompositions=ctx.decompositions
    )
    return rewrite_calls(gm, torch.ops.zpp.gather_param.default, rewrite, "qwz", ctx.label, where=quantized(ctx))


def quantized(ctx: PassContext) -> Callable[[fx.Node], bool]:
    """gather_param marker -> whether qwZ gathers its weight as int8 (Config.qwz_parameters)."""
    name_of = parameter_names_of(ctx)
    return lambda marker: ctx.config.quantizes_weight(name_of(marker))


def quantized_all_gather(
    local: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    group_size: int,
    group_name: str,
    block: int,
    kernels: QuantKernels,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """qwZ's forward gather: quantize this rank's part (flat, zero-padded to shard_numel) into the
    payload, one all-gather, dequantize to `dtype` (the part's, or Config.param_dtype: the master
    shard itself is what gets quantized).

    Returns (full weight, the gathered int8 payloads); hpZ keeps a slice of the latter.
    """
    flat = local.reshape(-1)
    payload = kernels.quantize_packed(F.pad(flat, (0, shard_numel - flat.numel())), block)
    return gather_and_dequantize(payload, numel, shape, shard_numel, block, dtype, group_size, group_name, kernels)


def gather_and_dequantize(
    payload: Tensor,
    numel: int,
    shape: list[int],
    shard_numel: int,
    block: int,
    dtype: torch.dtype,
    group_size: int,
    group_name: str,
    kernels: QuantKernels,
) -> tuple[Tensor, Tensor]:
    """One all-gather of every rank's packed payload(s), dequantized to the full weight in `dtype`.

    Returns (full weight, the gathered int8 payloads it was dequantized from).
    """
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(payload, group_size, group_name))
    weight = weight_from_payloads(
        gathered, numel, shape, shard_numel, block, dtype, kernels.dequantize_packed, senders=group_size
    )
    return weight, gathered


def _quantized_gather(graph: fx.Graph, marker: fx.Node, *, block: int, decompositions: dict) -> fx.Node:
    weight, _, _ = inline_int8_gather(graph, marker, block, decompositions)
    return weight


def inline_int8_gather(
    graph: fx.Graph, marker: fx.Node, block: int, decompositions: dict
) -> tuple[fx.Node, fx.Node, tuple]:
    """Trace the int8 gather of either marker in at the insertion point.

    gather_param (qwZ: quantize with `block`, then gather) or gather_quantized_param (a payload
    stored int8: gather only). Returns (weight node, gathered-payloads node, the payloads' layout
    (numel, shape, shard_numel, block, dtype), as gather_quantized_param takes it).
    """
    source = marker.args[0]
    kernels = quant_kernels(source.meta["val"].device)
    if marker.target == torch.ops.zpp.gather_param.default:
        _, numel, shape, shard_numel, group_size, group_name = marker.args
        dtype = marker.kwargs.get("dtype") or source.meta["val"].dtype  # quantized from the master shard
        layout = (numel, list(shape), shard_numel, block, dtype)
        fn = functools.partial(
            quantized_all_gather,
            numel=numel, shape=list(shape), shard_numel=shard_numel, group_size=group_size, group_name=group_name,
            block=block, kernels=kernels, dtype=dtype,
        )  # fmt: skip
    else:
        _, numel, shape, shard_numel, block, dtype, group_size, group_name = marker.args
        layout = (numel, list(shape), shard_numel, block, dtype)
        fn = functools.partial(
            gather_and_dequantize,
            numel=numel, shape=list(shape), shard_numel=shard_numel, block=block, dtype=dtype,
            group_size=group_size, group_name=group_name, kernels=kernels,
        )  # fmt: skip
    log.debug("%s: %s kernels", marker.name, kernels.name)
    weight, gathered = inline_traced(graph, fn, [source], decompositions)
    # The gather serves the marker's parameter (passes/README.md, invariant 10), wherever it is
    # traced in: hpz inlines it after the marker, outside rewrite_calls. gathered = wait(gather).
    tag_collectives(gathered.args[0].prev, gathered, marker.meta.get("custom"))
    return weight, gathered, layout
