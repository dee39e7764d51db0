"""Triton kernels of the cuda backend, one module per op family."""
