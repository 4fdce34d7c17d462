"""qgZ's Triton int4 kernels against the reference (int4.py), bit for bit, in Triton's interpreter
on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU) or compiled on a GPU."""

import math

import pytest
import torch

from zpp_compile.codegen import int4 as reference
from zpp_compile.codegen import triton_int4
from zpp_compile.codegen.registry import quant_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (nodes, local ranks, chunk, block): both stages' shapes, the smallest block, a block that is not
# a power of two, several blocks per program and more than one program.
SHAPES = [(2, 2, 64, 8), (1, 4, 384, 128), (2, 4, 600, 200), (4, 1, 256, 64), (2, 3, 9216, 128)]


def _values(nodes: int, local: int, chunk: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(chunk + block)
    values = torch.randn(nodes, local, chunk, generator=g) * torch.exp(torch.randn(nodes, local, chunk, generator=g))
    values[0, 0, :block] = 0  # an all-zero block
    values[-1, -1, -1] = math.nan
    values[0, -1, 0] = -math.inf
    values[-1, 0, -block:] *= 1e-30  # tiny, still normal
    return values.to(dtype).to(DEVICE)


def _payloads(senders: int, rows: int, chunk: int, block: int) -> torch.Tensor:
    values = _values(senders, rows, chunk, block, torch.float32).cpu()
    return reference.quantize_int4_chunks(values, block)  # [G, R, P]


def _assert_same(got, want) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "error_feedback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nodes,local,chunk,block", SHAPES)
def test_swizzled_quantize_writes_the_reference_payload(nodes, local, chunk, block, dtype, feedback):
    values = _values(nodes, local, chunk, block, dtype)
    residual = torch.randn(local, nodes, chunk).to(DEVICE) if feedback else None
    got_payload, got_error = triton_int4.quantize_swizzled(values, block, residual)
    want_payload, want_error = reference.quantize_int4_swizzled(
        values.cpu(), block, None if residual is None else residual.cpu()
    )
    _assert_same(got_payload, want_payload)
    if feedback:
        _assert_same(got_error, want_error)
    else:
        assert got_error.numel() == 0


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "error_feedback"])
@pytest.mark.parametrize("senders,rows,chunk,block", SHAPES)
def test_fused_dequantize_reduce_requantize_matches_the_reference(senders, rows, chunk, block, feedback):
    payloads = _payloads(senders, rows, chunk, block)
    residual = torch.randn(rows, chunk) if feedback else None
    got = triton_int4.dequantize_reduce_requantize(
        payloads.to(DEVICE), chunk, block, None if residual is None else residual.to(DEVICE)
    )
    want = reference.dequantize_reduce_requantize(payloads, chunk, block, residual)
    _assert_same(got[0], want[0])
    if feedback:
        _assert_same(got[1], want[1])


@pytest.mark.parametrize("senders,rows,chunk,block", SHAPES)
def test_dequantize_reduce_sums_like_the_reference(senders, rows, chunk, block):
    payloads = _payloads(senders, rows, chunk, block)
    got = triton_int4.dequantize_reduce(payloads.to(DEVICE), chunk, block)
    _assert_same(got, reference.dequantize_reduce(payloads, chunk, block))


def test_registry_gives_cuda_the_triton_int4_kernels(monkeypatch):
    monkeypatch.delenv("ZPP_QUANT_KERNELS", raising=False)
    assert quant_kernels("cuda").int4_dequantize_reduce is torch.ops.zpp.triton_int4_dequantize_reduce
    assert quant_kernels("cpu").int4_dequantize_reduce is reference.dequantize_reduce
