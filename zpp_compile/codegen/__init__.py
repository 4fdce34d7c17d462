"""Kernels for the quantized collectives (qwZ / qgZ).

quantize.py: qwZ's int8 per-block quantize / dequantize as plain torch code, traced into the graph
by passes/qwz.py so that Inductor generates the CPU (C++/OpenMP) kernels. The Triton GPU kernels
and the per-device registry are not written yet.
"""
