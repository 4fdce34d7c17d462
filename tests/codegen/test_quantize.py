import math
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from zpp_compile.codegen.quantize import (
    QMAX,
    dequantize_int8_blocks,
    dequantize_packed,
    float32_from_bytes,
    quantize_int8_blocks,
    quantize_packed,
    unpack_payloads,
    weight_from_payloads,
)

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


def _floats_with_special_values() -> torch.Tensor:
    special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, -1.0]
    return torch.cat([torch.randn(246, generator=torch.Generator().manual_seed(0)) * 1e3, torch.tensor(special)])


def test_scales_read_back_from_strided_bytes_are_the_same_bits():
    values = _floats_with_special_values().view(4, 64)
    rows = torch.zeros(4, 8 + 4 * 64 + 12, dtype=torch.int8)  # a gathered buffer: scales mid-row
    rows[:, 8 : 8 + 4 * 64] = values.view(torch.int8)
    for raw in (rows[:, 8 : 8 + 4 * 64], rows[:, 8 : 8 + 4 * 64].view(torch.uint8)):
        assert torch.equal(float32_from_bytes(raw).view(torch.int32), values.view(torch.int32))
        compiled = torch.compile(float32_from_bytes, fullgraph=True)(raw)
        assert torch.equal(compiled.view(torch.int32), values.view(torch.int32))


def test_inductor_dequantizes_from_a_bucket_without_copying_the_scales_out():
    """Each parameter's payloads sit at their own offset in a bucket's gathered buffer. Bit-casting
    their scale bytes to float32 made Inductor copy them out first: a copy kernel, and a C++ compile,
    per parameter. Read back with integer arithmetic they fuse into the one dequantize kernel."""
    group, numel = 4, 3 * BLOCK
    shards = [torch.randn(numel) for _ in range(group)]
    payloads = torch.stack([quantize_packed(s, BLOCK) for s in shards])  # [group, payload]
    bucket = torch.cat([torch.zeros(group, 40, dtype=torch.int8), payloads], dim=1)  # another param first
    expected = dequantize_packed(payloads.reshape(-1), group, numel, BLOCK, torch.float32)

    def dequantize_from_bucket(bucket: torch.Tensor) -> torch.Tensor:
        q, scale = unpack_payloads(bucket[:, 40:], group, numel, BLOCK)
        return dequantize_int8_blocks(q, scale, torch.float32).reshape(-1)

    torch._dynamo.reset()
    torch._inductor.metrics.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = torch.compile(dequantize_from_bucket, fullgraph=True)(bucket)
    assert torch.equal(got, expected)
    assert torch._inductor.metrics.generated_kernel_count == 1


@pytest.mark.parametrize(
    ("shard", "numel"), [(3 * BLOCK, 3 * BLOCK * 4 - 100), (3 * BLOCK - 10, (3 * BLOCK - 10) * 4 - 7)]
)
def test_a_weight_shorter_than_its_payloads_is_written_once(shard, numel):
    """The weight's numel short of group x shard (rows chunked over ranks: GPT-2's 50257-row
    embedding) and, in the second case, each shard short of whole blocks: Inductor's code writes
    the weight alone, bitwise what dequantizing the padded whole and slicing gives. Dequantized
    whole then sliced, it wrote the padded buffer too, which nothing read."""
    group = 4
    full = torch.randn(group * shard)
    payloads = torch.cat([quantize_packed(full[r * shard : (r + 1) * shard], BLOCK) for r in range(group)])
    expected = dequantize_packed(payloads, group, shard, BLOCK, torch.float32)[:numel].view(-1, 1)

    def weight(payloads: torch.Tensor) -> torch.Tensor:
        return weight_from_payloads(payloads, numel, [numel, 1], shard, BLOCK, torch.float32)

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, (code,) = run_and_get_code(torch.compile(weight, fullgraph=True), payloads)
    assert torch.equal(got, expected) and torch.equal(weight(payloads), expected)
    sizes = [
        math.prod(int(d) for d in s.split(",") if d.strip())
        for s in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", code)
    ]
    assert [size for size in sizes if size >= numel] == [numel]


@pytest.mark.parametrize("shard", [BLOCK - 16, 2 * BLOCK], ids=["padded", "whole_blocks"])
def test_payloads_from_fewer_senders_are_read_affinely_from_a_bucket(shard):
    """hpZ's backward: 2 senders each send 2 of the 4 payloads, and bucketing puts them at an
    offset in each sender's row. Read by (sender, payload of the sender) the dequantize kernel
    loads the int8 values as vectors at affine indices; read by a flat payload number it
    gathered them one by one at indices nested in floor divisions by the sender's slice length,
    which Inductor's vector analysis took ~15 ms each to answer (docs/compile_time.md)."""
    group, senders = 4, 2
    numel = group * shard - (7 if shard % BLOCK else 0)
    full = torch.randn(group * shard)
    payloads = [quantize_packed(full[r * shard : (r + 1) * shard], BLOCK) for r in range(group)]
    per_sender = torch.stack(payloads).view(senders, -1)  # [senders, 2 payloads]
    bucket = torch.cat(
        [torch.zeros(senders, 40, dtype=torch.int8), per_sender, torch.ones(senders, 24, dtype=torch.int8)], 1
    )
    expected = dequantize_packed(torch.cat(payloads), group, shard, BLOCK, torch.float32)[:numel]
    width = per_sender.shape[1]

    def weight(bucket: torch.Tensor) -> torch.Tensor:
        gathered = bucket[:, 40 : 40 + width].reshape(-1)  # as Inductor's bucketing splits it out
        return weight_from_payloads(gathered, numel, [numel], shard, BLOCK, torch.float32, senders=senders)

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, (code,) = run_and_get_code(torch.compile(weight, fullgraph=True), bucket)
    assert torch.equal(got, expected) and torch.equal(weight(bucket), expected)
    assert "Vectorized<int8_t>::loadu(in_ptr0" in code, "the int8 values are loaded as vectors"
    assert "tmpbuf" not in code, "no element-by-element gather"
    assert f"{width}L" not in code, "no floor division by the sender's slice length"
