"""Quantized weights on a torch CPU: what forms each can be kept in, and the host-side conversions.

Q4_0, Q4_1 and Q4_K map exactly onto torch's int4 groupwise CPU kernel with a zero point, in groups
of 32: in every group, w = (q - 8) * scale + zero, q a 4-bit unsigned value. The grouped int4 formats
of GPTQ and AWQ checkpoints (INT4_G32 to INT4_G256, w = (q - z) * s) map onto the same kernel in
their own group size, with zero = (8 - z) * s, and their columns in the order they are stored (an
act-order weight's form permutes x instead). In bfloat16, formats whose values survive a symmetric
per-row int8 rounding (NMSE against the dequantized weight of about 1e-4 at most, measured by
bench/quantized_weight_error.py) may be kept as int8 rows, plain or packed for oneDNN. Every weight
may also be kept dense. Which of its candidate forms a weight is kept in, and which kernel
multiplies it at each number of rows, the kernel table says (kernel_table.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from candelabra.backends.torch.kernel_selection import Candidate, KernelSelector
from candelabra.backends.torch.weight_forms import (
    INT4_GROUP_SIZE,
    INT8_COLUMN_STEP,
    DenseWeight,
    Int4Weight,
    Int8Weight,
    KeptWeight,
)
from candelabra.core.contract.weights import (
    INT4_GROUP_FORMATS,
    INT4_GROUP_HEADER_BYTES,
    QuantizedTensor,
    int4_group_fields,
    unpack_int4_codes,
)

# GGUF formats that are int4 groups of 32, and the grouped int4 formats in their own group size.
GGUF_INT4_FORMATS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
INT4_FORMATS = GGUF_INT4_FORMATS | frozenset(INT4_GROUP_FORMATS)
# Per-row int8 NMSE against the dequantized weight, random 896 x 4864 weights (bench/quantized_weight_error.py):
# Q5_0, Q8_0, Q5_1 4e-5; Q2_K, Q3_K 9e-5; Q5_K, Q6_K 1e-4. On real weights the error follows the tensor's
# outliers, not its format: 6e-5 to 7.5e-4 in Qwen2.5-0.5B, 6e-5 to 1.6e-4 in Gemma 3 270M.
INT8_FORMATS = frozenset({"Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K"})
# So each tensor of those formats is checked as it loads: int8 only while its NMSE against the dequantized
# weight stays within what llama.cpp's own rounding of activations to 8 bits costs a legacy-format matmul
# (the conformance threshold for Q8_0 to Q5_1).
INT8_NMSE_BUDGET = 3e-4
# int8 rows change a weight's values, which only bfloat16's own rounding of activations and outputs
# hides: in float32 and float16 the models level compares with transformers far more tightly.
INT8_COMPUTE_DTYPES = frozenset({torch.bfloat16})


# host side: GGUF blocks to int4 groups and int8 rows


def int4_groupwise(weight: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight` as int4 groups of `int4_group_size(weight)` values, its columns in their stored order
    (`weight.column_order`): nibbles uint8 [N, K] (0..15), scales and zeros float32 [N, K / group], with
    (nibbles - 8) * scale + zero equal to the stored values up to float32 rounding of scale and zero."""
    decode = _INT4_DECODERS.get(weight.format) or (_int4_group if weight.format in INT4_GROUP_FORMATS else None)
    if decode is None:
        raise ValueError(f"{weight.format} does not map onto int4 groups; int4 formats are {sorted(INT4_FORMATS)}")
    rows, columns = weight.shape
    blocks = weight.blocks.reshape(rows, columns // weight.values_per_block, weight.bytes_per_block)
    nibbles, scales, zeros = decode(blocks)
    groups = columns // int4_group_size(weight)
    return nibbles.reshape(rows, columns), _float32(scales).reshape(rows, groups), _float32(zeros).reshape(rows, groups)


def int4_group_size(weight: QuantizedTensor) -> int:
    """Values per group of `weight`'s int4 groups: 32 for the GGUF formats, a grouped format's own."""
    return INT4_GROUP_FORMATS.get(weight.format, INT4_GROUP_SIZE)


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


def _int4_group(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # float16 s, float16 z, then value 2i in the low nibble of byte i, 2i + 1 in its high nibble;
    # w = (q - z) * s = (q - 8) * s + (8 - z) * s
    packed, scale, zero_point = int4_group_fields(blocks, blocks.shape[-1] * 2 - 2 * INT4_GROUP_HEADER_BYTES)
    scale, zero_point = scale.astype(np.float64), zero_point.astype(np.float64)
    return unpack_int4_codes(packed[..., 0, :]), scale[..., 0], (8 - zero_point[..., 0]) * scale[..., 0]


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


# choosing what to keep


def candidates(weight: QuantizedTensor, dtype: torch.dtype, readable: bool = False) -> list[Candidate]:
    """The forms `weight` may be kept in for compute dtype `dtype`; with `readable`, only forms whose rows
    can be read back (an embedding table and the LM head tied to it), the blocks as stored first, the
    most compact."""
    found = _candidates(weight, dtype, readable)
    if readable:
        found.sort(key=lambda c: c.form != "blocks" or bool(c.unavailable))
    return found


def _candidates(weight: QuantizedTensor, dtype: torch.dtype, readable: bool) -> list[Candidate]:
    from candelabra.backends.torch.packed_int8 import PackedInt8Weight, onednn_int8_problem

    blocks = _blocks_candidate(weight, dtype)
    dense = Candidate("dense", lambda: DenseWeight(torch.from_numpy(weight.dequantize()).to(dtype)))
    if weight.format in INT4_FORMATS:
        return [Candidate("int4", lambda: Int4Weight.from_groups(*int4_groupwise(weight), dtype, weight.column_order)),
                *blocks, dense]
    if weight.format not in INT8_FORMATS or dtype not in INT8_COMPUTE_DTYPES or weight.shape[1] % INT8_COLUMN_STEP:
        return [*blocks, dense]
    dequantized = weight.dequantize()
    values, scales = int8_rowwise(dequantized)
    dense = Candidate("dense", lambda: DenseWeight(torch.from_numpy(dequantized).to(dtype)))
    if int8_error(dequantized, values, scales) > INT8_NMSE_BUDGET:
        return [*blocks, dense]
    found = [Candidate("int8", lambda: Int8Weight.from_rows(values, scales, dtype))]
    if not readable:
        rows = Int8Weight.from_rows(values, scales, dtype)
        found.append(Candidate(
            "int8_packed", lambda: PackedInt8Weight(torch.from_numpy(values), rows.scales, dtype),
            values=rows.dense,
            unavailable=onednn_int8_problem()))
    return [*found, *blocks, dense]


def _blocks_candidate(weight: QuantizedTensor, dtype: torch.dtype) -> list[Candidate]:
    """The weight as the file stores it, for the C kernels of block_products.py, where they read its format."""
    from candelabra.backends.torch.cpu.block_products import NATIVE_FORMATS, NativeBlocksWeight, native_blocks_available

    if weight.format not in NATIVE_FORMATS:
        return []
    available, detail = native_blocks_available()
    return [Candidate("blocks", lambda: NativeBlocksWeight.from_quantized(weight, dtype),
                      unavailable=None if available else detail)]


def keep_quantized(weight: QuantizedTensor, dtype: torch.dtype, selector: KernelSelector | None = None,
                   readable: bool = False) -> KeptWeight | None:
    """`weight` in the form `selector` takes for its format and shape from the kernel table (without one,
    the first available candidate, with its default kernels), or None where dense is the only candidate:
    the caller then keeps a plain dense tensor."""
    found = candidates(weight, dtype, readable)
    if [c.form for c in found if not c.unavailable] == ["dense"]:
        return None
    if selector is None:
        return next(c for c in found if not c.unavailable).build()
    return selector.keep(weight.format, weight.shape, found)


def int8_error(dense: np.ndarray, values: np.ndarray, scales: np.ndarray, rows_per_chunk: int = 8192) -> float:
    """NMSE of the int8 rows against `dense`, a chunk of rows at a time (an LM head has 150,000 of them)."""
    error = scale = 0.0
    for start in range(0, dense.shape[0], rows_per_chunk):
        part = dense[start:start + rows_per_chunk].astype(np.float64)
        rebuilt = values[start:start + rows_per_chunk] * scales[start:start + rows_per_chunk, None].astype(np.float64)
        error += float(np.sum(np.square(rebuilt - part)))
        scale += float(np.sum(np.square(part)))
    return error / scale if scale else 0.0

