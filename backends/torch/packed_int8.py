"""int8 weights in oneDNN's packed layout, multiplied on the CPU's int8 dot-product units.

torch's own int8 weight-only kernel reads the weight again for every row of x, and `torch._int_mm`
repacks the weight on every call. oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise`)
takes a weight packed once, at load, for this CPU's AMX or VNNI units. It wants int8 activations
with one scale for the whole batch, so x is split per row into two int8 parts (`split_into_int8_parts`),
stacked into one batch of unit scale, and the parts' products are scaled per row and added in float32.
Medians on 2 cores with AMX, each of 24 different weights in turn (as a step reads them, from memory),
ms: int8 weight-only kernel / packed:

    9728 x 896   1 row 0.70 / 0.44,   4 rows 0.94 / 0.42,   16 rows 1.71 / 0.55,   64 rows 6.7 / 0.97
    896 x 4864   1 row 0.18 / 0.19,   4 rows 0.27 / 0.17,   16 rows 0.71 / 0.24,   64 rows 2.96 / 0.45
"""

from __future__ import annotations

import functools
import os

import torch

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


@functools.cache
def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's quantized linear and the CPU it runs on can use it: a tiny
    weight packed and multiplied once, the first time it is asked."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    try:
        weight = PackedInt8Weight(torch.ones(16, 32, dtype=torch.int8), torch.ones(16), torch.bfloat16)
        return bool(torch.all(weight.matmul(torch.ones(1, 32, dtype=torch.bfloat16)) == 32))
    except Exception:  # noqa: BLE001 - any failure of a builtin op means: not on this build or CPU
        return False


class PackedInt8Weight:
    """A [N, K] weight of int8 values with one scale per output row, packed for oneDNN, for x @ W.T."""

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

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T [..., N]."""
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(flat.shape[0], self.shape[0], dtype=self.dtype)
        rows_per_call = max(1, PRODUCT_ELEMENTS // (2 * (self.slices[0][1] - self.slices[0][0])))
        for first in range(0, flat.shape[0], rows_per_call):
            rows = flat[first:first + rows_per_call]
            parts, part_scales = split_into_int8_parts(rows.float())
            for (start, stop), packed, scales, zero_points in zip(self.slices, self.packed, self.scales,
                                                                  self._zero_points):
                products = torch.ops.onednn.qlinear_pointwise(parts, 1.0, 0, packed, scales, zero_points, None,
                                                              1.0, 0, torch.float32, "none", [], "")
                add_scaled_parts(products, part_scales, out[first:first + rows.shape[0], start:stop])
        return out.reshape(*x.shape[:-1], self.shape[0])


def split_into_int8_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x [M, K] (overwritten) to int8 parts [2M, K] and their scales float32 [2M, 1], with
    x = parts[:M] * scales[:M] + parts[M:] * scales[M:] to within 1/64516 of each row's largest |x|:
    the first part rounds x to 127 steps of that largest value, the second what the first left
    over, which is finer than bfloat16 rounds any value above 1/128 of it."""
    first, first_scale = _int8_rows(x)
    remainder = x.sub_(first * first_scale)
    second, second_scale = _int8_rows(remainder)
    return torch.cat([first, second]).to(torch.int8), torch.cat([first_scale, second_scale])


def add_scaled_parts(products: torch.Tensor, part_scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The float32 products [2M, N] of `split_into_int8_parts`'s parts, scaled by their part scales
    (in place) and the two halves added into `out` [M, N]."""
    products.mul_(part_scales)
    rows = products.shape[0] // 2
    return torch.add(products[:rows], products[rows:], out=out)


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded per row to integers in [-127, 127] (as float32) and the row scales [M, 1]."""
    scale = x.abs().amax(dim=1, keepdim=True).div_(127)
    scale = torch.where(scale > 0, scale, 1.0)
    return torch.round(x / scale), scale
