import math

import pytest
import torch

from zpp_compile.codegen.quantize import QMAX, dequantize_int8_blocks, quantize_int8_blocks

BLOCK = 64


def _samples(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return {
        "normal": torch.randn(4096, generator=g),
        "uniform": torch.rand(4096, generator=g) * 2 - 1,
        "heavy_tailed": torch.distributions.StudentT(2.0).sample((4096,)),
        "tiny": torch.randn(4096, generator=g) * 1e-30,
    }[name]


@pytest.mark.parametrize("name", ["normal", "uniform", "heavy_tailed", "tiny"])
def test_error_per_element_is_at_most_half_a_step(name):
    x = _samples(name)
    q, scale = quantize_int8_blocks(x, BLOCK)
    error = (dequantize_int8_blocks(q, scale, torch.float32) - x).view(-1, BLOCK).abs()
    # Half a quantization step, plus float32 rounding of q * scale.
    bound = scale[:, None] / 2 * (1 + 1e-5) + x.view(-1, BLOCK).abs() * 2**-23
    assert bool((error <= bound).all())
    assert q.abs().max() <= QMAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_keeps_dtype_and_stays_within_the_bound(dtype):
    x = torch.randn(1000).to(dtype)
    q, scale = quantize_int8_blocks(x, BLOCK)
    back = dequantize_int8_blocks(q, scale, dtype)[: x.numel()]
    assert back.dtype == dtype
    step = scale.repeat_interleave(BLOCK)[: x.numel()]
    eps = torch.finfo(dtype).eps
    assert bool(((back.float() - x.float()).abs() <= step / 2 + x.float().abs() * eps * 2).all())


def test_zero_block_gives_exact_zeros_and_no_nan():
    x = torch.zeros(3 * BLOCK)
    x[BLOCK:] = torch.randn(2 * BLOCK)
    q, scale = quantize_int8_blocks(x, BLOCK)
    back = dequantize_int8_blocks(q, scale, torch.float32)
    assert scale[0] == 0 and bool((back[:BLOCK] == 0).all()) and not back.isnan().any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_value_poisons_its_block_only(bad):
    x = torch.randn(2 * BLOCK)
    x[5] = bad
    q, scale = quantize_int8_blocks(x, BLOCK)
    back = dequantize_int8_blocks(q, scale, torch.float32)
    assert bool(back[:BLOCK].isnan().all()), "a broken block must not turn into finite numbers"
    assert bool(back[BLOCK:].isfinite().all())


def test_inductor_kernel_matches_eager():
    x = torch.randn(5000)
    compiled = torch.compile(quantize_int8_blocks)
    (q, s), (qc, sc) = quantize_int8_blocks(x, BLOCK), compiled(x, BLOCK)
    assert torch.equal(q, qc) and torch.equal(s, sc)
