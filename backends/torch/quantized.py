"""GGUF quantized weights kept on a torch CPU device, for weight-only matmuls.

Q4_0, Q4_1 and Q4_K map exactly onto torch's int4 groupwise-32 CPU kernel with a zero point: in
every 32-value group, w = (q - 8) * scale + zero, q a 4-bit unsigned value. Formats whose values
survive a symmetric per-row int8 rounding (NMSE against the dequantized weight of about 1e-4 at
most, measured by bench/quantized_weight_error.py) are kept as int8. Formats in neither table, and
compute dtypes the kernels are slow in, are left to the caller, which keeps a dense copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from candelabra.backends.torch.packed_int8 import PackedInt8Weight, add_scaled_parts, split_into_int8_parts
from candelabra.core.contract.weights import QuantizedTensor

INT4_GROUP_SIZE = 32
# torch packs int4 weights in tiles of 16 output rows; other row counts are padded up to it.
INT4_ROW_TILE = 16
# The int8 kernel reads K in steps of 16: other widths crash it or give wrong sums (torch 2.13).
INT8_COLUMN_STEP = 16
INT4_FORMATS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
# Per-row int8 NMSE against the dequantized weight, random 896 x 4864 weights (bench/quantized_weight_error.py):
# Q5_0, Q8_0, Q5_1 4e-5; Q2_K, Q3_K 9e-5; Q5_K, Q6_K 1e-4. All within the 1e-4 budget, and int8 halves the
# bytes of a dense bfloat16 copy and its time at one row. On real weights the error follows the tensor's
# outliers, not its format: 6e-5 to 7.5e-4 in Qwen2.5-0.5B, 6e-5 to 1.6e-4 in Gemma 3 270M.
INT8_FORMATS = frozenset({"Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K"})
# So each tensor of those formats is checked as it loads: int8 only while its NMSE against the dequantized
# weight stays within what llama.cpp's own rounding of activations to 8 bits costs a legacy-format matmul
# (the conformance threshold for Q8_0 to Q5_1), else a dense copy.
INT8_NMSE_BUDGET = 3e-4
# The CPU kernels are fast only in bfloat16. Both take float16 and float32 too, but there they ran 10 to 40
# times slower than a dense matmul of the same dtype (torch 2.13, AVX-512 BF16 CPU, 1 and 16 rows).
QUANTIZED_COMPUTE_DTYPES = frozenset({torch.bfloat16})
# The weight-only kernels multiply row by row: their time grows with every row of x, while a dense
# bfloat16 GEMM's barely does. From this many rows on an int4 weight is rebuilt densely and multiplied by
# that, INT4_SLICE_ELEMENTS at a time: the rebuild makes float32 temporaries that must stay in the cache.
# Medians on 2 cores with AMX, ms, int4 kernel / rebuilt in slices of 1 Mi elements (whole):
#   896 x 4864   64 rows 3.03 / - (7.1), 128 rows 6.04 / 5.88 (7.1), 512 rows - / 8.2
#   9728 x 896  128 rows 12.4 / 11.0 (35), 512 rows - / 14.7
INT4_DENSE_FROM_ROWS = 128
INT4_SLICE_ELEMENTS = 2**20
# An int8 weight multiplies x split into two int8 parts (`_int8_activation_matmul`) from
# INT8_ACTIVATIONS_FROM_ROWS rows, and a dense rebuild from INT8_DENSE_FROM_ROWS. torch._int_mm runs on the
# int8 dot-product units (AMX or VNNI) and reads the weight once for all rows, where the int8 kernel reads
# it again for each; from 64 rows bfloat16 GEMMs on a rebuilt weight win. Medians on 2 cores with AMX, ms,
# int8 kernel / split x / rebuilt:
#   9728 x 896 (gate and up)  4 rows 0.42 / 0.55 / -, 8 rows 0.84 / 0.74 / 1.76, 16 rows 1.71 / 0.82 / 1.46,
#                             32 rows - / 1.15 / 1.68, 64 rows 6.7 / 1.82 / 1.95, 128 rows - / 4.05 / 2.72
#   896 x 4864 (down)         8 rows 0.38 / 0.43 / 0.67, 32 rows - / 0.68 / 0.75, 64 rows 2.96 / 1.19 / 0.99
#   151936 x 896 (LM head)    8 rows 21 / 13.8 / 29, 32 rows - / 26 / 34, 64 rows 170 / 39 / 41
INT8_ACTIVATIONS_FROM_ROWS = 8
INT8_DENSE_FROM_ROWS = 64
# The int32 products of a wide weight are made and scaled a slice of output columns at a time, so that
# each slice is still in the cache when it is scaled (an LM head's products for 64 rows are 78 MB).
PRODUCT_SLICE_ELEMENTS = 2**19
# With a dense copy kept beside the quantized weight (keep_quantized's dense_copy), batches of this
# many rows or more multiply by it: at 16 rows 0.6 ms against int8's 0.9 for a 4864 x 896 weight.
DENSE_COPY_FROM_ROWS = 8
# Elements of the shared buffer dense slices are rebuilt in (32 MiB of bfloat16): reused rather than
# allocated, since fresh pages cost more than the rebuild itself. A weight that fits is rebuilt whole;
# a larger one (an LM head) in slices of SLICE_ELEMENTS, which the GEMM then reads from the cache: the
# LM head above at 64 rows took 136 ms in slices of 16 Mi elements, 79 in slices of 4 Mi.
SCRATCH_ELEMENTS = 16 * 2**20
SLICE_ELEMENTS = 4 * 2**20


# host side: GGUF blocks to int4 groups and int8 rows


def int4_groupwise(weight: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight` as int4 groups of 32: nibbles uint8 [N, K] (0..15), scales and zeros float32 [N, K / 32],
    with (nibbles - 8) * scale + zero equal to `weight.dequantize()` up to float32 rounding of scale and zero."""
    decode = _INT4_DECODERS.get(weight.format)
    if decode is None:
        raise ValueError(f"{weight.format} does not map onto int4 groups; int4 formats are {sorted(INT4_FORMATS)}")
    rows, columns = weight.shape
    blocks = weight.blocks.reshape(rows, columns // weight.values_per_block, weight.bytes_per_block)
    nibbles, scales, zeros = decode(blocks)
    groups = columns // INT4_GROUP_SIZE
    return nibbles.reshape(rows, columns), _float32(scales).reshape(rows, groups), _float32(zeros).reshape(rows, groups)


def int8_rowwise(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output row: values int8 [N, K] and scales float32 [N] with values * scale
    near `values`; scale = max |row| / 127, or 1 for an all-zero row."""
    largest = np.max(np.abs(values), axis=1).astype(np.float32)
    scales = np.where(largest > 0, largest / np.float32(127), np.float32(1))
    scaled = values / scales[:, None]  # one float temporary, rounded and clipped in place: LM heads are big
    np.rint(scaled, out=scaled)
    np.clip(scaled, -127, 127, out=scaled)
    return scaled.astype(np.int8), scales


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 2 bytes float16 d, 16 bytes of nibbles; w = (q - 8) * d
    scale = _float16_field(blocks, 0)
    return _low_then_high_nibbles(blocks[..., 2:]), scale, np.zeros_like(scale)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # float16 d, float16 m, 16 bytes of nibbles; w = q * d + m = (q - 8) * d + (m + 8 d)
    scale, minimum = _float16_field(blocks, 0), _float16_field(blocks, 2)
    return _low_then_high_nibbles(blocks[..., 4:]), scale, minimum + 8 * scale


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # float16 d, float16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles holding eight
    # sub-blocks of 32; sub-block j: w = d * sc_j * q - dmin * m_j
    d, dmin = _float16_field(blocks, 0)[..., None], _float16_field(blocks, 2)[..., None]
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    scale = d * sub_scales
    # 32 bytes hold two sub-blocks: the low nibbles the first, the high nibbles the second
    nibbles = _low_then_high_nibbles(blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32))
    return nibbles, scale, 8 * scale - dmin * sub_mins


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight 6-bit scales and eight 6-bit mins from 12 bytes. Bytes 0-3 hold scales 0-3 and bytes 4-7
    mins 0-3 in their low 6 bits; scales and mins 4-7 take their low 4 bits from bytes 8-11 (scales
    the low nibble, mins the high one) and their top 2 bits from the top 2 bits of bytes 0-3 and 4-7."""
    first, second, low_bits = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (low_bits & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (low_bits >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float64), mins.astype(np.float64)


def _low_then_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] to values [..., 2n]: the low nibbles of all n bytes, then their high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _float16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as float64 [...]."""
    field = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)
    return field[..., 0].astype(np.float64)


def _float32(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32)


_INT4_DECODERS: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k,
}  # fmt: skip


# torch side: handles that multiply


class Int4Weight:
    """A [N, K] weight as int4 groups of 32 with a scale and a zero each, for x @ W.T on a CPU.

    Besides torch's packed layout it keeps the nibbles two to a byte in row order, from which a dense
    copy is rebuilt for a batch of INT4_DENSE_FROM_ROWS rows or more.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, shape: tuple[int, int],
                 nibble_pairs: torch.Tensor) -> None:
        self.packed = packed  # uint8 [N', K / 2] in torch's own int4 CPU layout, N' = N padded to whole tiles
        self.scales_and_zeros = scales_and_zeros  # compute dtype [K / 32, N', 2]
        self.shape = shape
        self.nibble_pairs = nibble_pairs  # uint8 [N, K / 2]: column 2j in the low nibble, 2j + 1 in the high
        self.dense_copy: torch.Tensor | None = None  # the same values, dense, for batches (keep_quantized)

    @classmethod
    def from_groups(cls, nibbles: np.ndarray, scales: np.ndarray, zeros: np.ndarray, dtype: torch.dtype) -> Int4Weight:
        """From `int4_groupwise`'s arrays, with scales and zeros rounded to `dtype`, the compute dtype."""
        rows = nibbles.shape[0]
        padding = -rows % INT4_ROW_TILE
        # padded rows are (8 - 8) * 0 + 0: zero, and cut off the output
        nibbles = np.pad(nibbles, ((0, padding), (0, 0)), constant_values=8)
        scales, zeros = np.pad(scales, ((0, padding), (0, 0))), np.pad(zeros, ((0, padding), (0, 0)))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(nibbles.astype(np.int32)), 1)
        scales_and_zeros = torch.from_numpy(np.stack([scales.T, zeros.T], axis=-1)).to(dtype).contiguous()
        pairs = nibbles[:rows, 0::2] | (nibbles[:rows, 1::2] << 4)
        return cls(packed, scales_and_zeros, (rows, nibbles.shape[1]), torch.from_numpy(pairs))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros) + _nbytes(self.nibble_pairs)

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values [stop - start, K] in the compute dtype."""
        pairs = self.nibble_pairs[start:stop]
        return self._values(pairs, self.scales_and_zeros[:, start:start + pairs.shape[0]])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [..., K] in the compute dtype (an embedding lookup)."""
        flat = ids.reshape(-1)
        values = self._values(self.nibble_pairs.index_select(0, flat), self.scales_and_zeros.index_select(1, flat))
        return values.reshape(*ids.shape, self.shape[1])

    def _values(self, pairs: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        rows, columns = pairs.shape[0], self.shape[1]
        nibbles = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(rows, -1, INT4_GROUP_SIZE)
        # in float32: a zero point cancels most of (q - 8) * scale, which bfloat16 arithmetic would blur
        groups = scales_and_zeros.transpose(0, 1).float()
        values = (nibbles.float() - 8) * groups[..., 0:1] + groups[..., 1:2]
        return values.reshape(rows, columns).to(self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T [..., N]."""
        rows = _rows(x)
        if self.dense_copy is not None and rows >= DENSE_COPY_FROM_ROWS:
            return torch.nn.functional.linear(x, self.dense_copy)
        if rows >= INT4_DENSE_FROM_ROWS:
            return _dense_matmul(x, self.shape, lambda start, stop, _out: self.dense(start, stop), INT4_SLICE_ELEMENTS)
        out = _rows_at_once(x, lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, INT4_GROUP_SIZE, self.scales_and_zeros))
        rows = self.shape[0]
        return out if out.shape[-1] == rows else out[..., :rows].contiguous()


class Int8Weight:
    """A [N, K] weight as int8 values with one scale per output row, for x @ W.T."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        if values.shape[1] % INT8_COLUMN_STEP:
            raise ValueError(f"the int8 kernel takes widths in steps of {INT8_COLUMN_STEP}, got {values.shape[1]}")
        self.values = values  # int8 [N, K]
        self.scales = scales  # compute dtype [N]
        self.shape = (values.shape[0], values.shape[1])
        self.dense_copy: torch.Tensor | None = None  # the same values, dense, for batches (keep_quantized)

    @classmethod
    def from_rows(cls, values: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> Int8Weight:
        """From `int8_rowwise`'s arrays, with scales rounded to `dtype`, the compute dtype."""
        return cls(torch.from_numpy(np.ascontiguousarray(values)), torch.from_numpy(scales).to(dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values) + _nbytes(self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [..., K] in the compute dtype (an embedding lookup)."""
        flat = ids.reshape(-1)
        values = self.values.index_select(0, flat).to(self.dtype) * self.scales.index_select(0, flat)[:, None]
        return values.reshape(*ids.shape, self.shape[1])

    def dense(self, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values [stop - start, K] in the compute dtype (into `out`)."""
        values, scales = self.values[start:stop], self.scales[start:stop, None]
        if out is None:
            return values.to(self.dtype) * scales
        return out.copy_(values).mul_(scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T [..., N]."""
        rows = _rows(x)
        if self.dense_copy is not None and rows >= DENSE_COPY_FROM_ROWS:
            return torch.nn.functional.linear(x, self.dense_copy)
        if rows >= INT8_DENSE_FROM_ROWS:
            # int8 values are exact in bfloat16, so the slices are the values alone, and the row
            # scales are applied to the product, as the int8 kernel applies them
            product = _dense_matmul(x, self.shape, lambda start, stop, out: out.copy_(self.values[start:stop]))
            return product.mul_(self.scales)
        if rows >= INT8_ACTIVATIONS_FROM_ROWS:
            return _rows_at_once(x, lambda rows: _int8_activation_matmul(rows, self.values, self.scales))
        return _rows_at_once(x, lambda rows: torch.ops.aten._weight_int8pack_mm(rows, self.values, self.scales))


def _int8_activation_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (values * scales[:, None]).T in x's dtype, on int8 dot products: x split into two
    int8 parts (`split_into_int8_parts`), both multiplying the weight in int32, exactly, in one
    torch._int_mm of 2M rows."""
    rows = x.shape[0]
    parts, part_scales = split_into_int8_parts(x.float())
    out = torch.empty(rows, values.shape[0], dtype=x.dtype)
    step = max(INT8_COLUMN_STEP, PRODUCT_SLICE_ELEMENTS // (2 * rows) // INT8_COLUMN_STEP * INT8_COLUMN_STEP)
    for start in range(0, values.shape[0], step):
        stop = min(values.shape[0], start + step)
        product = torch._int_mm(parts, values[start:stop].T).float()
        out[:, start:stop] = add_scaled_parts(product, part_scales, product[:rows]).mul_(scales[start:stop].float())
    return out


def _dense_matmul(x: torch.Tensor, shape: tuple[int, int], rebuild, slice_elements: int | None = None) -> torch.Tensor:
    """x @ W.T through dense slices of W: `rebuild(start, stop, out)` gives rows start:stop of W,
    written into `out` (a slice of this thread's scratch buffer) where it can. Slices of
    `slice_elements`, else the whole weight where it fits the scratch buffer."""
    rows, columns = shape
    if slice_elements is None:
        slice_elements = rows * columns if rows * columns <= SCRATCH_ELEMENTS else SLICE_ELEMENTS
    step = max(1, slice_elements // columns)
    scratch = _scratch(x.dtype)

    def dense(start: int, stop: int) -> torch.Tensor:
        return rebuild(start, stop, scratch[: (stop - start) * columns].view(stop - start, columns))

    if step >= rows:
        return torch.nn.functional.linear(x, dense(0, rows))
    flat = x.reshape(-1, columns)
    out = torch.empty(flat.shape[0], rows, dtype=x.dtype)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[:, start:stop] = flat @ dense(start, stop).T
    return out.reshape(*x.shape[:-1], rows)


_SCRATCH = threading.local()


def _scratch(dtype: torch.dtype) -> torch.Tensor:
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    if dtype not in buffers:
        buffers[dtype] = torch.empty(SCRATCH_ELEMENTS, dtype=dtype)
    return buffers[dtype]


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _rows_at_once(x: torch.Tensor, multiply: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`multiply` takes a contiguous [M, K]; x's leading dims are flattened into M and restored after."""
    out = multiply(x.reshape(-1, x.shape[-1]).contiguous())
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# choosing what to keep


def keep_quantized(weight: QuantizedTensor, dtype: torch.dtype, dense_copy: bool = False,
                   packed: bool = False) -> Int4Weight | Int8Weight | PackedInt8Weight | None:
    """The form the CPU kernels multiply `weight` in for compute dtype `dtype`, or None where the caller
    should keep a dense copy (`dequantized`): a format in neither table, a dtype the kernels are slow in,
    or a weight whose outlying values per-row int8 would blur beyond INT8_NMSE_BUDGET. With `packed`,
    int8 rows are packed for oneDNN (faster at every batch size, but their rows can no longer be read
    back, as an embedding lookup does). With `dense_copy`, the kept form also holds its values densely,
    for batches of DENSE_COPY_FROM_ROWS rows or more: the same values, so a row's result does not
    depend on the batch it is in; such weights are not packed."""
    if dtype not in QUANTIZED_COMPUTE_DTYPES:
        return None
    kept = None
    if weight.format in INT4_FORMATS:
        kept = Int4Weight.from_groups(*int4_groupwise(weight), dtype)
    elif weight.format in INT8_FORMATS:
        dense = weight.dequantize()
        values, scales = int8_rowwise(dense)
        if int8_error(dense, values, scales) > INT8_NMSE_BUDGET:
            return None
        if packed and not dense_copy:
            return PackedInt8Weight(torch.from_numpy(values), torch.from_numpy(scales).to(dtype), dtype)
        kept = Int8Weight.from_rows(values, scales, dtype)
    if kept is not None and dense_copy:
        kept.dense_copy = kept.dense()
    return kept


def int8_error(dense: np.ndarray, values: np.ndarray, scales: np.ndarray, rows_per_chunk: int = 8192) -> float:
    """NMSE of the int8 rows against `dense`, a chunk of rows at a time (an LM head has 150,000 of them)."""
    error = scale = 0.0
    for start in range(0, dense.shape[0], rows_per_chunk):
        part = dense[start:start + rows_per_chunk].astype(np.float64)
        rebuilt = values[start:start + rows_per_chunk] * scales[start:start + rows_per_chunk, None].astype(np.float64)
        error += float(np.sum(np.square(rebuilt - part)))
        scale += float(np.sum(np.square(part)))
    return error / scale if scale else 0.0

