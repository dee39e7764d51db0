"""The MLP activations as Triton kernels: gated SiLU and GELU (x [..., 2I] -> [..., I]) and GELU.

Each element is loaded, computed in float32 and rounded to the input dtype once at the store.
Semantics are those of `Ops.silu_and_mul`, `Ops.gelu_and_mul` and `Ops.gelu`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options

SILU = tl.constexpr(0)
GELU_ERF = tl.constexpr(1)
GELU_TANH = tl.constexpr(2)
NO_GATE = tl.constexpr(-1)
# Ops.gated_linear's activations as kernel kinds.
GATED_KINDS = {"silu": SILU.value, "gelu": GELU_ERF.value, "gelu_tanh": GELU_TANH.value}
INV_SQRT2 = tl.constexpr(1 / math.sqrt(2))
SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2 / math.pi))
MAX_BLOCK = 1024


@triton.jit
def activate(x, KIND: tl.constexpr):
    """silu or gelu of float32 x."""
    if KIND == SILU:
        return x / (1.0 + tl.exp(-x))
    elif KIND == GELU_ERF:
        return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT2))
    else:
        inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        # tanh(z) = 1 - 2 / (exp(2z) + 1): exp overflowing to inf still gives the right limit (+-1).
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        return 0.5 * x * (1.0 + tanh)


@triton.jit
def gated_input(row_ptr, offsets, up_offset, GATE: tl.constexpr):
    """A GEMV's float32 x at `offsets` of its row; with GATE an activation kind (not NO_GATE), the row is a
    gated MLP's [gate | up], up `up_offset` elements on, and x the gated value, rounded to the row's dtype
    as `_gated_kernel` stores it, so that the product is the one its output would give."""
    x = tl.load(row_ptr + offsets).to(tl.float32)
    if GATE != NO_GATE:
        up = tl.load(row_ptr + up_offset + offsets).to(tl.float32)
        x = (activate(x, GATE) * up).to(row_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _gated_kernel(x_ptr, out_ptr, inner, x_row_stride, out_row_stride, KIND: tl.constexpr, BLOCK: tl.constexpr,
                  DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate_row = x_ptr + row * x_row_stride
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    out = activate(gate, KIND) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _elementwise_kernel(x_ptr, out_ptr, numel, KIND: tl.constexpr, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, activate(x, KIND).to(out_ptr.dtype.element_ty), mask=mask)


def _gelu_kind(approximate: str) -> int:
    if approximate == "none":
        return GELU_ERF.value
    if approximate == "tanh":
        return GELU_TANH.value
    raise ValueError(f"unknown gelu approximation {approximate!r}; expected 'none' or 'tanh'")


def _gated(x: torch.Tensor, kind: int) -> torch.Tensor:
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"a gated activation needs an even last axis, got {width}")
    inner = width // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, width)
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, inner)
    if rows.shape[0] and inner:
        block = min(triton.next_power_of_2(inner), MAX_BLOCK)
        grid = (rows.shape[0], triton.cdiv(inner, block))
        _gated_kernel[grid](rows, out_rows, inner, rows.stride(0), out_rows.stride(0), KIND=kind, BLOCK=block,
                            **launch_options(x.device))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    return _gated(x, SILU.value)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x[..., :I], approximate) * x[..., I:] for x [..., 2I]."""
    return _gated(x, _gelu_kind(approximate))


def gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated values of x [..., 2I] by an `Ops.gated_linear` activation: "silu", "gelu", "gelu_tanh"."""
    if activation not in GATED_KINDS:
        raise ValueError(f"unknown gated activation {activation!r}; expected one of {tuple(GATED_KINDS)}")
    return _gated(x, GATED_KINDS[activation])


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU elementwise: "none" is the erf form, "tanh" the tanh approximation."""
    kind = _gelu_kind(approximate)
    dense = x.contiguous()
    out = torch.empty_like(dense)
    numel = dense.numel()
    if numel:
        block = min(triton.next_power_of_2(numel), MAX_BLOCK)
        _elementwise_kernel[(triton.cdiv(numel, block),)](dense, out, numel, KIND=kind, BLOCK=block,
                                                          **launch_options(x.device))
    return out
