"""Kernels for the quantized collectives (qwZ, qgZ).

quantize.py        the reference: int8 per-block quantize / dequantize and the packed payload, as
                   plain torch code that Inductor turns into C++/OpenMP kernels on CPU.
triton_quantize.py the same ops as hand-written Triton kernels (CUDA; the interpreter in tests).
registry.py        which of the two a device gets.
int4.py            qgZ's int4 per-block pack / unpack, plain torch (Inductor kernels on CPU and GPU).
"""
