"""Kernels for the quantized collectives (qwZ, qgZ).

quantize.py        the reference: int8 per-block quantize / dequantize and the packed payload, as
                   plain torch code that Inductor turns into C++/OpenMP kernels on CPU.
triton_quantize.py the same ops as hand-written Triton kernels (CUDA; the interpreter in tests).
registry.py        which kernel set (reference or Triton, int8 and int4) a device gets.
int4.py            qgZ's int4 per-block pack / unpack, plain torch (Inductor kernels on CPU and GPU).
triton_int4.py     qgZ's three int4 stages (quantize into the send order, dequantize-sum-requantize,
                   dequantize-sum) as Triton kernels, the int4 counterpart of triton_quantize.py.
"""
