"""GGUF Q4_0, Q4_1 and Q4_K weights, and GPTQ's and AWQ's grouped int4 ones (INT4_G32 to INT4_G256),
kept on a torch device as int4 groups of 32, multiplied by a Triton kernel.

The host decodes the blocks into int4 groups along K with a scale and a zero each (`int4_groupwise`,
shared with the torch backend: w = (q - 8) * scale + zero, a grouped format's zero being (8 - z) * s);
a group larger than the kernel's 32 gives each of its runs of 32 the same scale and zero. The device
keeps the nibbles two to a byte in the kernel's layout and the scales and zeros in the compute dtype.
An act-order weight keeps its columns in their stored order, and x's columns are taken in that order
before the kernel (one index_select).
"""

from __future__ import annotations

import numpy as np
import torch

from candelabra.backends.cuda.kernels.int4_matmul import GEMV_ROWS, int4_matmul, normed_int4_gemv, pack_nibbles
from candelabra.backends.cuda.kernels.norms import RowNorm
from candelabra.backends.torch.quantized import INT4_FORMATS, int4_groupwise
from candelabra.core.contract.weights import QuantizedTensor

# Rounding scales and zeros to the compute dtype rather than keeping them in float32 saves 0.125 bytes a
# weight (0.625 instead of 0.75, a sixth of a decode's reads) and costs little: NMSE of x @ W.T against the
# exact product, random 512 x 2048 weights, 8 rows, output rounded, float32 / compute-dtype scales: float16
# 7.5e-8 / 7.5e-8 (Q4_0), 8.3e-8 / 1.2e-7 (Q4_1), 8.8e-8 / 1.5e-7 (Q4_K); bfloat16 5.4e-6 / 7.3e-6 (Q4_0),
# 5.4e-6 / 8.3e-6 (Q4_1, Q4_K), measured when the kernel still rounded each weight to the dot's dtype (it now
# multiplies the exact q - 8 and applies scale and zero per group in float32).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Int4CudaWeight:
    """A [N, K] weight as int4 groups along K (the checkpoint's own: 32 for GGUF, 32 to 256 for GPTQ and
    AWQ), for x @ W.T: w = (q - 8) * scale + zero, its columns in the stored order `column_order` gives
    (None: the weight's own)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 column_order: torch.Tensor | None = None) -> None:
        self.packed = packed  # uint8 [N, K / 2], the layout of `pack_nibbles`
        self.scales = scales  # compute dtype [N, K / group]
        self.zeros = zeros  # compute dtype [N, K / group]
        self.column_order = column_order  # int64 [K]: stored column j is weight column column_order[j]
        self.shape = (int(packed.shape[0]), int(packed.shape[1]) * 2)

    @classmethod
    def from_quantized(cls, weight: QuantizedTensor, dtype: torch.dtype, device: torch.device | str) -> Int4CudaWeight:
        """`weight`, in Q4_0, Q4_1, Q4_K or a grouped int4 format, on `device` for compute dtype `dtype`."""
        if weight.format not in INT4_FORMATS:
            raise ValueError(f"Int4CudaWeight takes {', '.join(sorted(INT4_FORMATS))} weights, not {weight.format}; "
                             f"dequantize other formats or keep them in a form of their own")
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Int4CudaWeight computes in {', '.join(map(str, COMPUTE_DTYPES))}, not {dtype}")
        # every int4 format's group (GGUF's 32, GPTQ's and AWQ's 32 to 256) is one the kernels take
        nibbles, scales, zeros = int4_groupwise(weight)
        order = None if weight.column_order is None else _on(weight.column_order, torch.int64, device)
        return cls(_on(pack_nibbles(nibbles), torch.uint8, device),
                   _on(scales, dtype, device), _on(zeros, dtype, device), order)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        kept = (self.packed, self.scales, self.zeros, *([] if self.column_order is None else [self.column_order]))
        return sum(tensor.numel() * tensor.element_size() for tensor in kept)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T (+ bias [N], added as the kernel writes its output)
        [..., N] in the same dtype."""
        rows, width = self.shape
        if x.dtype != self.dtype:
            raise ValueError(f"x is {x.dtype}; this int4 weight computes in {self.dtype}")
        if x.shape[-1] != width:
            raise ValueError(f"x has {x.shape[-1]} features; the weight is {rows} x {width}")
        flat = x.reshape(-1, width)
        if self.column_order is not None:
            flat = flat.index_select(1, self.column_order)
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        return int4_matmul(flat, self.packed, self.scales, self.zeros, bias=bias).reshape(*x.shape[:-1], rows)

    def normed_matmul(self, x: torch.Tensor, norm: RowNorm, bias: torch.Tensor | None = None,
                      gate_output: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`Ops.rms_norm_linear` of one row x [1, K] by the GEMV normalising x as it loads it: (the product
        [1, N], the row plus residual); with `gate_output` an activation, of a gated MLP's gate and up rows,
        their gated values [1, N / 2] (`normed_int4_gemv`). None where it cannot (more rows, columns stored in
        another order)."""
        if x.shape[0] > GEMV_ROWS or self.column_order is not None or x.dtype != self.dtype:
            return None
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        return normed_int4_gemv(x, norm, self.packed, self.scales, self.zeros, bias=bias, gate_output=gate_output)


def _on(array: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
