"""Kernels for the quantized collectives (qwZ / qgZ): Triton on GPU, Inductor-generated on CPU.

Empty until the qwZ issue lands; plain ZeRO-3 needs no kernels of its own (Inductor lowers the
functional collectives and the copies around them).
"""
