"""Adapters from vLLM's kernel calling convention (outputs passed in, or inputs updated in place) to
candelabra's ops (results returned). Each returns NotImplemented for arguments the kernel does not
take, and the torch op runs instead."""

from __future__ import annotations

from collections.abc import Callable

try:
    import torch
except ImportError:  # the backend's probe says torch is missing; nothing here runs without it
    torch = None


def gated_into_output(kernel: Callable) -> Callable:
    """silu_and_mul(out [..., I], x [..., 2I]) -> the op silu_and_mul(x)."""

    def silu_and_mul(x):
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        kernel(out, x.contiguous())
        return out

    return silu_and_mul


def norm_into_output(kernel: Callable) -> Callable:
    """rms_norm(out, x, weight, eps) -> the op rms_norm(x, weight, eps); the kernel has no weight offset
    (Gemma's 1 + w) and takes a weight in x's dtype."""

    def rms_norm(x, weight, eps, weight_offset=0.0):
        if weight_offset or weight.dtype != x.dtype:
            return NotImplemented
        out = torch.empty_like(x)
        kernel(out, x.contiguous(), weight, eps)
        return out

    return rms_norm


def add_norm_in_place(kernel: Callable) -> Callable:
    """fused_add_rms_norm(x, residual, weight, eps), which leaves the norm in x and the sum in residual,
    -> the op add_rms_norm(x, residual, weight, eps), which returns both and changes neither input."""

    def add_rms_norm(x, residual, weight, eps, weight_offset=0.0):
        if weight_offset or weight.dtype != x.dtype or residual.dtype != x.dtype:
            return NotImplemented
        normed, summed = x.contiguous().clone(), residual.contiguous().clone()
        kernel(normed, summed, weight, eps)
        return normed, summed

    return add_rms_norm
