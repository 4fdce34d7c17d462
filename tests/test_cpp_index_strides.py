"""cpp_index_strides: the strides Inductor's C++ code generation asks for, answered without sympy
where plain (real Inductor, real code generation): the same answers as Inductor's, the same
kernels for the quantization code, and far fewer sympy.simplify calls."""

from __future__ import annotations

import contextlib
import re

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import sizevars
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from zpp_compile import cpp_index_strides
from zpp_compile.codegen import int4, quantize

X0, X1, X2 = sympy.symbols("x0 x1 x2", integer=True, nonnegative=True)
S0 = sympy.Symbol("s0", integer=True, positive=True)

# Indices of the kinds the quantization kernels read with (at offsets), and some that are not affine.
INDICES = [
    149760 * X0 + 256 * X1 + X2,
    149760 * X0 + 4 * X1 + 147459,
    -X0 + 7 * X1 + 3,
    sympy.Integer(42),
    780 * FloorDiv(X0, 576) + ModularIndexing(X0, 1, 576) + 1797120,
    780 * FloorDiv(X0, 576) + 4 * FloorDiv(ModularIndexing(X0, 1, 576), 256) + 1797891,
    260 * FloorDiv(X0, 192) + 2399539,
    S0 * X0 + X1,
    X0 * X1 + 5,
    X0**2 + 3,
    sympy.Add(X0, X0, evaluate=False),
    S0 >= 1024,  # Inductor's index_expr of a comparison
    sympy.true,
]


@pytest.mark.parametrize("index", INDICES, ids=str)
@pytest.mark.parametrize("vec_length", [None, 16, 32])
def test_strides_equal_inductors(index, vec_length):
    with cpp_index_strides.plain_strides():
        for var in (X0, X1, X2):
            ours, inductors = (
                cpp.stride_at_vec_range(index, var, vec_length),
                cpp_index_strides.inductors_stride(index, var, vec_length),
            )
            assert ours == inductors and type(ours) is type(inductors)


def test_affine_stride_reads_coefficients_and_declines_the_rest():
    assert cpp_index_strides.affine_stride(149760 * X0 + 4 * X1 + 147459, X1) == 4
    assert cpp_index_strides.affine_stride(149760 * X0 + 4 * X1 + 147459, X2) == 0
    assert cpp_index_strides.affine_stride(-X0 + 3, X0) == -1
    assert cpp_index_strides.affine_stride(S0 * X0 + X1, X0) is None
    assert cpp_index_strides.affine_stride(FloorDiv(X0, 4) + X1, X1) is None


def _simplify_calls(monkeypatch, fn, *args, fresh: bool = True) -> int:
    """sympy.simplify calls while answering `fn(*args)`; `fresh`: Inductor's caches emptied first."""
    if fresh:
        for cached in (sizevars.stride_at_vec_range, sizevars.simplify_index_in_vec_range, sizevars.stride_at):
            cached.cache_clear()
    calls = 0
    simplify = sympy.simplify

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return simplify(*a, **k)

    monkeypatch.setattr(sympy, "simplify", counting)
    fn(*args)
    monkeypatch.setattr(sympy, "simplify", simplify)
    return calls


def test_plain_strides_call_no_sympy_simplify_outside_they_do(monkeypatch):
    index = 149760 * X0 + 4 * X1 + 147459
    assert _simplify_calls(monkeypatch, cpp.stride_at_vec_range, index, X1, 32) > 0  # Inductor's way
    with cpp_index_strides.plain_strides():
        assert _simplify_calls(monkeypatch, cpp.stride_at_vec_range, index, X1, 32) == 0
        # Indices an offset apart share one answer: the second is a hit in Inductor's cache.
        strided = 260 * FloorDiv(X0, 192) + 4 * X1
        assert _simplify_calls(monkeypatch, cpp.stride_at_vec_range, strided + 2399539, X0, 32) > 0
        assert _simplify_calls(monkeypatch, cpp.stride_at_vec_range, strided + 7196019, X0, 32, fresh=False) == 0


W = 96  # shards of 96 * 96 / 2 values are whole blocks; of 96 / 2 values, padded ones (a gather)
SHAPES = [(W * W,), (W,), (4 * W * W,)]


def _dequantize_weights(payloads: torch.Tensor) -> list[torch.Tensor]:
    weights, start = [], 0
    for (numel,) in SHAPES:
        shard = numel // 2
        size = 2 * quantize.payload_numel(shard, 64)
        weights.append(
            quantize.weight_from_payloads(payloads[start : start + size], numel, [numel], shard, 64, torch.bfloat16)
        )
        start += size
    return weights


def _quantize_and_reduce(values: torch.Tensor, payloads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    swizzled, _ = int4.quantize_int4_swizzled(values, 64)
    requantized, _ = int4.dequantize_reduce_requantize(payloads, 512, 64)
    return swizzled, requantized, quantize.quantize_packed(values.reshape(-1)[:1000], 64)


PROGRAMS = {
    "dequantize_packed": (
        _dequantize_weights,
        (torch.zeros(sum(2 * quantize.payload_numel(n // 2, 64) for (n,) in SHAPES), dtype=torch.int8),),
    ),
    "int4_and_quantize_packed": (
        _quantize_and_reduce,
        (torch.randn(2, 2, 512), torch.randint(0, 255, (2, 8, int4.chunk_payload_numel(512, 64)), dtype=torch.uint8)),
    ),
}


def _kernels_and_simplify_calls(monkeypatch, fn, args, exact: bool) -> tuple[list[str], int]:
    torch._dynamo.reset()
    context = cpp_index_strides.plain_strides() if exact else contextlib.nullcontext()
    with context, inductor_config.patch(fx_graph_cache=False):
        box = {}
        calls = _simplify_calls(
            monkeypatch, lambda: box.update(code=run_and_get_code(torch.compile(fn, backend="inductor"), *args)[1])
        )
    # The graph's number (its "# AOT ID" line) counts torch.compile calls; the rest is the code.
    return [re.sub(r"# AOT ID: .*\n", "", code) for code in box["code"]], calls


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_quantization_kernels_generate_the_same_code_asking_sympy_less(monkeypatch, program):
    fn, args = PROGRAMS[program]
    inductors, inductors_calls = _kernels_and_simplify_calls(monkeypatch, fn, args, exact=False)
    exact, exact_calls = _kernels_and_simplify_calls(monkeypatch, fn, args, exact=True)
    assert "cpp_fused" in "".join(exact)  # C++ kernels were generated
    assert exact == inductors
    assert exact_calls < 0.6 * inductors_calls, (exact_calls, inductors_calls)
