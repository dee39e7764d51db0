"""RMS norm and the fused residual add + RMS norm, as Triton kernels.

One program normalises one row: the whole row (hidden size padded to a power of two) is held in
registers, squared and summed in float32, scaled, and rounded to the input dtype once at the store.
Semantics are those of `Ops.rms_norm` and `Ops.add_rms_norm`. The one-row GEMVs normalise their x with
`normed_input` (`Ops.rms_norm_linear`), in the same arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.kernels.dependent_launch import launch_options, start_dependents, wait_for_prior


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    hidden,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    summed_row_stride,
    eps,
    weight_offset,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    start_dependents(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    wait_for_prior(DEPENDENT)

    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the input dtype before the norm reads it, as the unfused ops would.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_row_stride + cols, x, mask=mask)

    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    inverse_rms = 1.0 / tl.sqrt(mean_square + eps)
    out = x * inverse_rms * weight
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


class RowNorm(NamedTuple):
    """The RMS norm a GEMV applies to its x as it loads it (`Ops.rms_norm_linear`): of x + `residual` (a
    [M, K] of x's dtype) where there is one, else of x."""

    weight: torch.Tensor
    eps: float
    weight_offset: float = 0.0
    residual: torch.Tensor | None = None

    def check(self, x: torch.Tensor) -> None:
        """ValueError unless this norm fits x [M, K]."""
        residual = self.residual
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError(f"the residual {list(residual.shape)} {residual.dtype} does not match x "
                             f"{list(x.shape)} {x.dtype}")
        if self.weight.shape != (x.shape[1],):
            raise ValueError(f"the norm's weight {list(self.weight.shape)} does not match x's width {x.shape[1]}")

    def joined_like(self, x: torch.Tensor) -> torch.Tensor:
        """Where the GEMV stores x + residual (laid out as contiguous x), or x itself without a residual."""
        return x if self.residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)

    def kernel_arguments(self, x: torch.Tensor, joined: torch.Tensor) -> tuple:
        """A GEMV kernel's residual, norm weight, joined row, eps and weight offset arguments for contiguous x."""
        residual = x if self.residual is None else self.residual.contiguous()
        return residual, self.weight.contiguous(), joined, float(self.eps), float(self.weight_offset)

    @staticmethod
    def absent(x: torch.Tensor) -> tuple:
        """The same arguments for a GEMV that normalises nothing."""
        return x, x, x, 0.0, 0.0


@triton.jit
def normed_input(x_row, residual_row, weight_ptr, joined_row, offsets, weight_offset, write_joined,
                 RESIDUAL: tl.constexpr):
    """(s * (weight_offset + weight), s) at `offsets` of the row, in float32, for s = x (+ residual, rounded
    to x's dtype as `add_rms_norm` rounds it, and stored at `joined_row` where `write_joined`): a normalised
    row before its 1 / rms, which a product applies to its sums (`split_k.finish_tile`), and what the squares
    for it sum."""
    s = tl.load(x_row + offsets)
    if RESIDUAL:
        s = (s.to(tl.float32) + tl.load(residual_row + offsets).to(tl.float32)).to(x_row.dtype.element_ty)
        tl.store(joined_row + offsets, s, mask=write_joined)
    s = s.to(tl.float32)
    return s * (tl.load(weight_ptr + offsets).to(tl.float32) + weight_offset), s


def _num_warps(block: int) -> int:
    """About 8 of the row's values per thread, between 4 and 16 warps."""
    return max(4, min(16, block // (32 * 8)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, hidden] view (a copy only when its last axis is strided)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _launch(x, residual, weight, eps, weight_offset):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x_rows = _rows(x)
    residual_rows = _rows(residual) if residual is not None else x_rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    out_rows, summed_rows = out.view(-1, hidden), summed.view(-1, hidden)
    num_rows = x_rows.shape[0]
    if num_rows and hidden:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x_rows,
            residual_rows,
            weight.contiguous(),
            out_rows,
            summed_rows,
            hidden,
            x_rows.stride(0),
            residual_rows.stride(0),
            out_rows.stride(0),
            summed_rows.stride(0),
            float(eps),
            float(weight_offset),
            ADD_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
            **launch_options(x.device),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """x [..., H] / rms(x) * (weight_offset + weight [H]), in x's dtype."""
    out, _ = _launch(x, None, weight, eps, weight_offset)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x's dtype; one pass over the row."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )
    return _launch(x, residual, weight, eps, weight_offset)
