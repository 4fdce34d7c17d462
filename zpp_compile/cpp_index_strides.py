"""Inductor's C++ vectorization analysis, answered without sympy where the answer is plain.

For every load and store of a kernel, Inductor's C++ code generation asks how far the index moves
when the vectorized loop variable steps by one (`codegen.cpp.stride_at_vec_range`): it rewrites
the index for the vector range and calls `sympy.simplify` twice, ~5 ms an index on this project's
machine. Its cache misses whenever two indices differ by their offset alone, which is how the
quantized payloads are read: every parameter's dequantize kernel reads the same pattern at its own
offset in the bucket, and reading a float32 scale from its four bytes makes that four indices.
Choosing the vector tiling was ~0.1 s of code generation per dequantize kernel, ~0.025 s with this
module (`docs/compile_time.md`).

While the backend's Inductor compiles run (`plain_strides()`), the stride is answered
  * for an index affine in its loop variables with integer coefficients (`a*x0 + b*x1 + c`, which
    is what most kernels index with): the coefficient of the variable, which is what
    simplify(index(var + 1) - index) gives;
  * for any other index plus an integer offset: the stride of the index without the offset, when
    that is an integer (an offset cancels out of the difference), so indices that differ only by
    their offset share Inductor's cache;
  * otherwise by Inductor, as before.
The generated kernels are the same (tests/test_cpp_index_strides.py compares their source).
Only code generation that runs in the compiling thread is covered (Inductor's default): with
TORCHINDUCTOR_FX_COMPILE_MODE=subprocess it runs elsewhere, Inductor's way.
"""

from __future__ import annotations

from typing import Any, ContextManager, Optional

import sympy

from .inductor_patching import ScopedPatch


def plain_strides() -> ContextManager[None]:
    """Within: Inductor's C++ code generation gets plain strides without sympy (see the module docstring)."""
    return _PATCH.scope()


def affine_stride(index: sympy.Expr, var: sympy.Symbol) -> Optional[sympy.Integer]:
    """The coefficient of `var` in `index` (zero where `var` is absent, as Inductor's stride_at)
    when `index` is a sum of integers, symbols and integer-times-symbol terms; None otherwise."""
    stride = sympy.S.Zero
    for term in sympy.Add.make_args(index):
        if term.is_Integer:
            continue
        coefficient, symbol = term.as_coeff_Mul()
        if not (coefficient.is_Integer and symbol.is_Symbol):
            return None
        if symbol == var:
            stride += coefficient  # summed: an unevaluated Add may name a variable twice
    return stride


def inductors_stride(index: sympy.Basic, var: sympy.Symbol, vec_length: Optional[int] = None) -> sympy.Expr:
    """Inductor's own answer (codegen.cpp's stride_at_vec_range as torch ships it)."""
    return _PATCH.original("stride_at_vec_range")(index, var, vec_length)


def _stride_at_vec_range(index: sympy.Basic, var: sympy.Symbol, vec_length: Optional[int] = None) -> sympy.Expr:
    # A boolean index (Inductor's index_expr(s0 >= 1024)) is not an Expr: Inductor's way.
    if not _PATCH.active() or not isinstance(index, sympy.Expr):
        return inductors_stride(index, var, vec_length)
    stride = affine_stride(index, var)
    if stride is not None:
        return stride
    offset, rest = index.as_coeff_Add()
    if offset.is_Integer and offset != 0:
        # A first miss costs Inductor two answers (this and the full index's below); a repeat is
        # a hit in Inductor's cache.
        stride = inductors_stride(rest, var, vec_length)
        if stride.is_Integer:
            return stride
    return inductors_stride(index, var, vec_length)


def _cpp_codegen() -> Any:
    from torch._inductor.codegen import cpp

    return cpp


# Outside plain_strides() Inductor answers as before.
_PATCH = ScopedPatch("zpp_compile_plain_strides", _cpp_codegen, {"stride_at_vec_range": _stride_at_vec_range})
