"""Kernels for the quantized collectives (qwZ; qgZ to come).

quantize.py        the reference: int8 per-block quantize / dequantize and the packed payload, as
                   plain torch code that Inductor turns into C++/OpenMP kernels on CPU.
triton_quantize.py the same ops as hand-written Triton kernels (CUDA; the interpreter in tests).
registry.py        which of the two a device gets.
"""
