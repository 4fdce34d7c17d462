"""The Triton kernels against the reference (quantize.py), bit for bit, in Triton's interpreter
on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU) or compiled on a GPU."""

import math

import pytest
import torch

from zpp_compile.codegen import quantize as reference
from zpp_compile.codegen import triton_quantize  # triton is a test dependency: never skipped
from zpp_compile.codegen.registry import quant_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (shard numel, block): uneven tails, the smallest block, a block that is not a power of two,
# several blocks per Triton program and more than one program.
SHAPES = [(77, 8), (300, 64), (1000, 200), (5000, 256), (9000, 1024)]


def _shards(numel: int, block: int, dtype: torch.dtype, ranks: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(numel + block)
    shards = [torch.randn(numel, generator=g).to(dtype) for _ in range(ranks)]
    shards[0][: min(block, numel)] = 0  # an all-zero block
    shards[1][-1] = math.nan
    shards[2][0] = -math.inf
    shards[2][-block // 2 :] *= 1e-30 if dtype == torch.float32 else 1e-4  # tiny, still normal
    return [s.to(DEVICE) for s in shards]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,block", SHAPES)
def test_quantize_writes_the_reference_payload_bit_for_bit(numel, block, dtype):
    for shard in _shards(numel, block, dtype):
        got = triton_quantize.quantize_packed(shard, block)
        assert torch.equal(got.cpu(), reference.quantize_packed(shard.cpu(), block))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,block", SHAPES)
def test_dequantize_reads_the_reference_values_bit_for_bit(numel, block, dtype):
    shards = _shards(numel, block, dtype)
    payloads = torch.cat([reference.quantize_packed(s.cpu(), block) for s in shards])
    got = triton_quantize.dequantize_packed(payloads.to(DEVICE), len(shards), numel, block, dtype).cpu()
    want = reference.dequantize_packed(payloads, len(shards), numel, block, dtype)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_registry_gives_cuda_the_triton_kernels_and_cpu_the_inductor_ones(monkeypatch):
    monkeypatch.delenv("ZPP_QUANT_KERNELS", raising=False)
    assert quant_kernels("cuda").quantize_packed is torch.ops.zpp.triton_quantize_packed
    assert quant_kernels("cpu").quantize_packed is reference.quantize_packed
    monkeypatch.setenv("ZPP_QUANT_KERNELS", "triton")
    assert quant_kernels("cpu").name == "triton"
    monkeypatch.setenv("ZPP_QUANT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="ZPP_QUANT_KERNELS='cuda' is not a kernel set"):
        quant_kernels("cpu")
