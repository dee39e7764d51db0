"""int8 weights in oneDNN's packed layout, multiplied on the CPU's int8 dot-product units.

torch's own int8 weight-only kernel reads the weight again for every row of x, and `torch._int_mm`
repacks the weight on every call. oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise`)
takes a weight packed once, at load, for this CPU's AMX or VNNI units. It wants int8 activations
with one scale for the whole batch, so x is split per row into two int8 parts (`split_into_int8_parts`),
stacked into one batch of unit scale, and the parts' products are scaled per row and added in float32.
Whether that pays depends on the CPU, so it is one form the kernel table ranks per ISA level. On 2
cores with AMX, each of 24 different weights in turn (as a step reads them, from memory), medians in
ms, int8 weight-only kernel / packed:

    9728 x 896   1 row 0.70 / 0.44,   4 rows 0.94 / 0.42,   16 rows 1.71 / 0.55,   64 rows 6.7 / 0.97
    896 x 4864   1 row 0.18 / 0.19,   4 rows 0.27 / 0.17,   16 rows 0.71 / 0.24,   64 rows 2.96 / 0.45

On AMD Zen 4 (AVX-512 VNNI, no AMX) one row through 4864 x 896 took 0.14 ms in the weight-only kernel
and 189 ms packed; on AMD Zen 3 (AVX2) 0.9 and 11.
"""

from __future__ import annotations

import functools
import os

import torch

from candelabra.backends.torch.weight_forms import KeptWeight, add_scaled_parts, split_into_int8_parts

# Each call's float32 products (2M x N) stay below this many elements (16 MiB), and so below glibc's
# mmap threshold, reusing freed heap memory: 1024 stacked rows of a 9728-wide weight took 13.5 ms in
# one call (40 MB of fresh pages), 8 calls of 128 rows 7.8 ms.
PRODUCT_ELEMENTS = 2**22
# A weight is packed in slices of at most this many output rows, so that a wide one (an LM head of
# 151,936 rows) still takes all the rows of a decode batch per call. The LM head at 1, 16 and 64 rows,
# ms: slices of 32768 rows 4.4, 7.3, 18.2; of 8192 rows 6.5, 8.9, 19.8; whole, x in calls of 13 rows,
# 3.9, 10.7, 35.0 (torch's int8 weight-only kernel: 9 to 10 ms at one row).
SLICE_ROWS = 32768


# oneDNN keeps every primitive it builds, one per weight shape and number of rows, up to 1024 by
# default: serving 64 clients of the default model left 40 MiB of them. 64 still hold each weight
# shape at a dozen batch sizes; building one again costs about 0.6 ms.
PRIMITIVE_CACHE_VARIABLE, PRIMITIVE_CACHE_CAPACITY = "ONEDNN_PRIMITIVE_CACHE_CAPACITY", 64


def limit_primitive_cache() -> None:
    """Cap oneDNN's primitive cache unless the user set its size. oneDNN reads the variable once,
    when it builds its first primitive, so this is called before the probe below does."""
    os.environ.setdefault(PRIMITIVE_CACHE_VARIABLE, str(PRIMITIVE_CACHE_CAPACITY))


def onednn_int8_available() -> bool:
    return onednn_int8_problem() is None


@functools.cache
def onednn_int8_problem() -> str | None:
    """Why oneDNN's quantized linear cannot serve here, or None: it must exist in this torch and give
    the right sums on this CPU for a random full-range weight, checked the first time it is asked.
    On AVX2 without VNNI its u8 x s8 products saturate in 16 bits (NMSE 2e-3 on AMD Zen 3)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return "this torch has no oneDNN quantized linear"
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=generator)
    x = torch.randn(3, 256, generator=generator).to(torch.bfloat16)
    try:
        out = PackedInt8Weight(values, torch.ones(32), torch.bfloat16).matmul(x).double()
    except Exception as exc:  # noqa: BLE001 - any failure of a builtin op means: not on this build or CPU
        return f"oneDNN's quantized linear failed on this CPU ({type(exc).__name__}: {exc})"
    reference = x.double() @ values.double().T
    error = float(((out - reference) ** 2).sum() / (reference**2).sum())
    return None if error < 1e-4 else f"oneDNN's quantized linear gives wrong sums on this CPU (NMSE {error:.1g})"


class PackedInt8Weight(KeptWeight):
    """A [N, K] weight of int8 values with one scale per output row, packed for oneDNN, for x @ W.T.
    Its values cannot be read back."""

    form = "int8_packed"

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        rows, columns = values.shape
        self.shape = (rows, columns)
        step = -(-rows // -(-rows // SLICE_ROWS))  # equal slices of at most SLICE_ROWS
        self.slices = [(start, min(rows, start + step)) for start in range(0, rows, step)]
        self.packed = [torch.ops.onednn.qlinear_prepack(values[start:stop].contiguous(), [1, columns])
                       for start, stop in self.slices]
        scales = scales.float()  # the compute dtype's rounding of each row scale, held in float32
        self.scales = [scales[start:stop].contiguous() for start, stop in self.slices]
        self._zero_points = [torch.zeros(stop - start, dtype=torch.int64) for start, stop in self.slices]
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + s.numel() * 4 for p, s in zip(self.packed, self.scales))

    def kernels(self):
        return {"onednn": self._onednn}

    def _onednn(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.empty(flat.shape[0], self.shape[0], dtype=self.dtype)
        rows_per_call = max(1, PRODUCT_ELEMENTS // (2 * (self.slices[0][1] - self.slices[0][0])))
        for first in range(0, flat.shape[0], rows_per_call):
            rows = flat[first:first + rows_per_call]
            parts, part_scales = split_into_int8_parts(rows.to(torch.float32, copy=True))
            for (start, stop), packed, scales, zero_points in zip(self.slices, self.packed, self.scales,
                                                                  self._zero_points):
                products = torch.ops.onednn.qlinear_pointwise(parts, 1.0, 0, packed, scales, zero_points, None,
                                                              1.0, 0, torch.float32, "none", [], "")
                add_scaled_parts(products, part_scales, out[first:first + rows.shape[0], start:stop])
        return out
