"""GGUF quantized weights multiplied as the file stores them, by the C kernels of csrc/block_products.c.

Decode at one request is bound by the bytes of weight read per token. torch has no kernel for the
5-, 6- and 8-bit GGUF formats, so quantized.py widens them to int8 rows (8 bits a weight); this
module reads Q5_0 at 5.5 bits, Q6_K at 6.6, Q8_0 at 8.5 and the 4-bit formats at 4.5 to 5
(csrc/block_layouts.h describes the layouts).

The library is built ahead of time, one per ISA variant, and this CPU's is loaded (kernel_library.py).
Where none loads `native_blocks_available()` says why, and nothing raises.

A weight kept in its blocks (`NativeBlocksWeight`, form "blocks") has these kernels:

- blocks_float: x in float32; each chunk of 32 weights widened to float32 in registers, multiplied
  by x with FMAs and scaled: exact to float32 rounding at any compute dtype.
- blocks_int8: each row of x rounded once to int8 in blocks of 32 with a float scale, then integer
  dot products, as llama.cpp multiplies: the error of rounding x to 8 bits (NMSE about 3e-5 on
  random inputs, within conformance's quantized thresholds but not a float32 kernel's budget).
- blocks_rebuild (and blocks_rebuild_f32 where the compute dtype is not float32): slices of the
  weight decoded densely for a GEMM, for a prefill's many rows.

Both block kernels read each weight row once per call for all rows of x, and spread output rows
over torch.get_num_threads() threads. A call costs about 8 us of CPU beyond its arithmetic (ctypes,
the output's allocation); see bench/native_blocks_speed.py for their speed against torch's kernels.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.backends.torch.cpu import kernel_abi
from candelabra.backends.torch.cpu.kernel_library import kernels
from candelabra.backends.torch.kernel_table import Choice, int8_activations_from_environment
from candelabra.backends.torch.weight_forms import KeptWeight, dense_matmul
from candelabra.core.contract.weights import QuantizedTensor

NATIVE_FORMATS = frozenset(kernel_abi.FORMAT_CODES)
_DTYPE_CODES = {getattr(torch, name): code for name, code in kernel_abi.DTYPE_CODES.items()}
_KERNEL_CODES = kernel_abi.BLOCK_KERNEL_CODES
# blocks_rebuild decodes this many values at a time, whose float32 slice (4 MiB) stays in the cache for its GEMM.
REBUILD_SLICE_ELEMENTS = 2**20


def native_blocks_available() -> tuple[bool, str]:
    """Whether the kernel library is loaded here, and what it is or why not; never raises."""
    loaded = kernels()
    return loaded.library is not None, loaded.detail


def _checked(status: int, call: str) -> None:
    if status == -4:
        raise IndexError(f"{call}: {kernel_abi.status_message(status)}")
    if status:
        raise RuntimeError(f"{call}: {kernel_abi.status_message(status)}")


def default_choice(dtype: torch.dtype) -> Choice:
    """What a blocks weight made without a kernel table runs at its bands (1, 4, 16, 64, 256 rows):
    the exact float kernel (int8 activations where $CANDELABRA_INT8_ACTIVATIONS allows them) up to 64 rows,
    and slices rebuilt for a float32 GEMM at 256. Medians on 2 cores of an AMD EPYC (Zen 3, AVX2), ms,
    blocks_int8 / blocks_float / dense float32 GEMM:
    896 x 4864 Q6_K  1 row 0.22 / 0.49 / 1.0, 64 rows 5.2 / 9.0 / 5.4, 256 rows 33 / 50 / 17 (rebuilt: 24)."""
    kernel = "blocks_int8" if int8_activations_from_environment() else "blocks_float"
    rebuild = "blocks_rebuild" if dtype == torch.float32 else "blocks_rebuild_f32"
    return Choice("blocks", (kernel,) * 4 + (rebuild,))


class NativeBlocksWeight(KeptWeight):
    """A [N, K] weight kept in its GGUF blocks, exactly as stored, for x @ W.T on a CPU."""

    form = "blocks"
    rounds_activations = frozenset({"blocks_int8"})

    def __init__(self, format: str, blocks: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
        if format not in NATIVE_FORMATS:
            raise ValueError(f"no kernel reads {format} blocks; it reads {sorted(NATIVE_FORMATS)}")
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"compute dtype {dtype} is not one of {sorted(map(str, _DTYPE_CODES))}")
        values, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
        expected = shape[0] * (shape[1] // values) * size
        if shape[1] % values or blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.numel() != expected:
            raise ValueError(f"{format} blocks of a {shape[0]} x {shape[1]} weight are {expected} contiguous bytes "
                             f"(K a multiple of {values}), got {blocks.dtype} {list(blocks.shape)}")
        build = kernels()
        if build.library is None:
            raise RuntimeError(build.detail)
        self.format = format
        self.blocks = blocks  # uint8 [N, K / values_per_block * bytes_per_block], as the file stores them
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self._matmul = build.library.gguf_blocks_matmul
        self._matmul_normed = build.library.gguf_blocks_matmul_normed
        self._matmul_gated = build.library.gguf_blocks_matmul_gated
        self._decode = build.library.gguf_blocks_decode
        self._codes = (kernel_abi.FORMAT_CODES[format], _DTYPE_CODES[dtype])

    @classmethod
    def from_quantized(cls, weight: QuantizedTensor, dtype: torch.dtype) -> NativeBlocksWeight:
        """`weight`'s blocks, copied (so that a mapped checkpoint can be let go), multiplied in `dtype`."""
        blocks = torch.from_numpy(np.array(weight.blocks, dtype=np.uint8, order="C", copy=True))
        return cls(weight.format, blocks, weight.shape, dtype)

    def default_choice(self) -> Choice:
        return default_choice(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def kernels(self):
        """blocks_float and blocks_int8 read the blocks; for prefill's many rows, blocks_rebuild decodes the
        weight a slice at a time into dense values for a GEMM (in float32 too, where the compute dtype is not)."""
        found = {"blocks_float": self._float, "blocks_int8": self._int8,
                 "blocks_rebuild": lambda x: dense_matmul(x, self.shape, self.dense, REBUILD_SLICE_ELEMENTS)}
        if self.dtype != torch.float32:
            found["blocks_rebuild_f32"] = lambda x: dense_matmul(
                x.float(), self.shape, self.dense, REBUILD_SLICE_ELEMENTS).to(self.dtype)
        return found

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        return self._multiply(x, _KERNEL_CODES["blocks_float"])

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        return self._multiply(x, _KERNEL_CODES["blocks_int8"])

    def _multiply(self, x: torch.Tensor, kernel: int) -> torch.Tensor:
        """x [M, K] contiguous in the compute dtype, on the CPU, to x @ W.T [M, N]."""
        rows, columns = self.shape
        if (x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != columns or not x.is_contiguous()
                or x.device.type != "cpu"):
            raise ValueError(f"x must be a contiguous CPU {self.dtype} [M, {columns}], got {x.dtype} {list(x.shape)}")
        out = torch.empty((x.shape[0], rows), dtype=self.dtype)
        format, dtype = self._codes
        status = self._matmul(format, kernel, self.blocks.data_ptr(), rows, columns, x.data_ptr(), out.data_ptr(),
                              x.shape[0], dtype, torch.get_num_threads())
        if status:
            _checked(status, f"{self.format} matmul")
        return out

    def normed_matmul(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`Ops.rms_norm_linear` in one call, where the kernel chosen for x's rows reads the blocks (the norm is
        then part of preparing x's rows, and the normalised values stay float32): (x' @ W.T, s) for s = x +
        residual (or x) and x' = s / rms(s) * (norm_weight + offset). None where another kernel was chosen, or x,
        residual and norm_weight are not all CPU tensors of the compute dtype."""
        rows, columns = self.shape
        given = [x, norm_weight] + ([] if residual is None else [residual])
        if (x.shape[-1] != columns or norm_weight.shape != (columns,)
                or (residual is not None and residual.shape != x.shape)
                or any(t.dtype != self.dtype or t.device.type != "cpu" for t in given)):
            return None
        flat = x.reshape(-1, columns)
        kernel = self._block_kernel(flat.shape[0])
        if kernel is None:
            return None
        # held here until the call returns: each pointer below is into one of these
        flat, norm_weight = flat.contiguous(), norm_weight.contiguous()
        added = None if residual is None else residual.reshape(-1, columns).contiguous()
        summed = None if residual is None else torch.empty_like(flat)
        out = torch.empty((flat.shape[0], rows), dtype=self.dtype)
        format, dtype = self._codes
        status = self._matmul_normed(
            format, kernel, self.blocks.data_ptr(), rows, columns, flat.data_ptr(),
            None if added is None else added.data_ptr(), None if summed is None else summed.data_ptr(),
            norm_weight.data_ptr(), eps, offset, out.data_ptr(), flat.shape[0], dtype, torch.get_num_threads())
        if status:
            _checked(status, f"{self.format} matmul")
        joined = x if summed is None else summed.reshape(x.shape)
        return out.reshape(*x.shape[:-1], rows), joined

    def gated_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`Ops.gated_linear` with the silu activation in one call, where the kernel chosen for x's rows reads the
        blocks: (silu(gate) * up) @ W.T for x = [gate | up] [..., 2K], the gated values kept float32. None where
        another kernel was chosen, or x is not a CPU tensor of the compute dtype and that width."""
        rows, columns = self.shape
        flat = x.reshape(-1, 2 * columns) if x.shape[-1] == 2 * columns else None
        if flat is None or x.dtype != self.dtype or x.device.type != "cpu":
            return None
        kernel = self._block_kernel(flat.shape[0])
        if kernel is None:
            return None
        flat = flat.contiguous()
        out = torch.empty((flat.shape[0], rows), dtype=self.dtype)
        format, dtype = self._codes
        status = self._matmul_gated(format, kernel, self.blocks.data_ptr(), rows, columns, flat.data_ptr(),
                                    out.data_ptr(), flat.shape[0], dtype, torch.get_num_threads())
        if status:
            _checked(status, f"{self.format} matmul")
        return out.reshape(*x.shape[:-1], rows)

    def _block_kernel(self, rows: int) -> int | None:
        """The code of the kernel chosen for `rows` rows of x where it reads the blocks (the norm and the gate
        can then be done as it prepares x), else None."""
        return _KERNEL_CODES.get(self.choice.kernel_for(rows))

    def dense(self, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values [stop - start, K] in the compute dtype, or written into
        `out` (contiguous, of that shape) in its dtype."""
        first, last, _ = slice(start, stop).indices(self.shape[0])
        count = max(0, last - first)
        if out is None:
            out = torch.empty((count, self.shape[1]), dtype=self.dtype)
        elif out.shape != (count, self.shape[1]) or not out.is_contiguous() or out.dtype not in _DTYPE_CODES:
            raise ValueError(f"out must be a contiguous [{count}, {self.shape[1]}] tensor, got {list(out.shape)}")
        _checked(self._decode(self._codes[0], self.blocks.data_ptr(), self.shape[0], self.shape[1], None, first,
                              count, out.data_ptr(), _DTYPE_CODES[out.dtype], torch.get_num_threads()),
                 f"{self.format} rows")
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [..., K] in the compute dtype (an embedding lookup)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.numel(), self.shape[1]), dtype=self.dtype)
        _checked(self._decode(self._codes[0], self.blocks.data_ptr(), self.shape[0], self.shape[1], flat.data_ptr(),
                              0, flat.numel(), out.data_ptr(), self._codes[1], torch.get_num_threads()),
                 f"{self.format} rows")
        return out.reshape(*ids.shape, self.shape[1])
