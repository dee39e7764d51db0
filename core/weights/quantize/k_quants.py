"""GGML's k-quant formats, super-blocks of 256 values, as llama.cpp's reference quantizers
(quantize_row_q2_K_ref to quantize_row_q6_K_ref) make them: each sub-block of 16 or 32 values gets
its own scale (and minimum) from a search (see `k_quant_search`), those are quantized to 4, 6 or 8
bits against one float16 scale (and one float16 minimum) for the super-block, and the values are
rounded again onto the sub-block scales as stored.

Each function takes float32 super-blocks [count, 256] and returns their bytes, uint8 [count, block
bytes], laid out as ggml-common.h's block structs.
"""

from __future__ import annotations

import numpy as np

from candelabra.core.weights.quantize.block_math import (
    F32,
    as_float16,
    first_largest_magnitude,
    float16_bytes,
    nearest,
    pack_bits,
)
from candelabra.core.weights.quantize.k_quant_search import (
    ZERO_BLOCK,
    refined_symmetric_scale,
    scale_and_minimum,
    symmetric_scale,
)

SUPER_BLOCK = 256


def q2_k(blocks: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16: codes 0..3, 4-bit scales and minimums."""
    columns = _by_sub_block(blocks, 16)
    scales, minimums, codes = scale_and_minimum(columns, np.abs(columns), 3, -0.5, 0.1, 15, absolute=True)
    scales, minimums = scales.reshape(len(blocks), 16), minimums.reshape(len(blocks), 16)
    largest_scale, largest_minimum = _largest(scales), _largest(minimums)
    scale_codes = _levels(scales, largest_scale, 15)
    minimum_codes = _levels(minimums, largest_minimum, 15)
    packed = (scale_codes | (minimum_codes << 4)) & 0xFF
    scale = as_float16(np.where(largest_scale > 0, largest_scale / F32(15), F32(0)))
    minimum = as_float16(np.where(largest_minimum > 0, largest_minimum / F32(15), F32(0)))
    step = scale.astype(F32)[:, None] * (packed & 15).astype(F32)
    offset = minimum.astype(F32)[:, None] * (packed >> 4).astype(F32)
    codes = _rounded_again(blocks, _from_sub_blocks(codes, len(blocks)), step, offset, 16, 0, 3)
    return np.concatenate([packed.astype(np.uint8), _two_bit_codes(codes), float16_bytes(scale),
                           float16_bytes(minimum)], axis=1)


def q3_k(blocks: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16: codes -4..3, signed 6-bit scales."""
    scales, codes = refined_symmetric_scale(_by_sub_block(blocks, 16), 4)
    scales = scales.reshape(len(blocks), 16)
    largest = first_largest_magnitude(scales, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = F32(-32) / largest
        levels = np.clip(nearest(inverse[:, None] * scales), -32, 31).astype(np.int64) + 32
        scale = as_float16(np.where(largest != 0, F32(1) / inverse, F32(0)))
    levels[largest == 0] = 0
    stored = np.concatenate([(levels[:, :8] & 15) | ((levels[:, 8:] & 15) << 4),
                             pack_bits((levels >> 4).reshape(len(blocks), 4, 4), 2)], axis=1)
    step = scale.astype(F32)[:, None] * (levels - 32).astype(F32)
    codes = _rounded_again(blocks, _from_sub_blocks(codes, len(blocks)), step, None, 16, -4, 3)
    high_bits = pack_bits((codes >> 2).reshape(len(blocks), 8, 32), 1)
    return np.concatenate([high_bits, _two_bit_codes(codes & 3), stored.astype(np.uint8), float16_bytes(scale)],
                          axis=1)


def q4_k(blocks: np.ndarray) -> np.ndarray:
    """8 sub-blocks of 32: codes 0..15, 6-bit scales and minimums."""
    header, codes = _six_bit_scales(blocks, 15, -1.0, 20)
    return np.concatenate([header, pack_bits(codes.reshape(len(blocks), 4, 2, 32), 4).reshape(len(blocks), 128)],
                          axis=1)


def q5_k(blocks: np.ndarray) -> np.ndarray:
    """8 sub-blocks of 32: codes 0..31, 6-bit scales and minimums."""
    header, codes = _six_bit_scales(blocks, 31, -0.5, 15)
    count = len(blocks)
    high_bits = pack_bits((codes >> 4).reshape(count, 8, 32), 1)
    low_bits = pack_bits((codes & 15).reshape(count, 4, 2, 32), 4).reshape(count, 128)
    return np.concatenate([header, high_bits, low_bits], axis=1)


def q6_k(blocks: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16: codes -32..31, signed 8-bit scales."""
    count = len(blocks)
    scales, codes = symmetric_scale(_by_sub_block(blocks, 16), 32)
    scales = scales.reshape(count, 16)
    largest = first_largest_magnitude(scales, axis=1)
    zero = np.abs(largest) < ZERO_BLOCK
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = F32(-128) / largest
        levels = np.minimum(nearest(inverse[:, None] * scales), 127)
        scale = as_float16(F32(1) / inverse)
    levels = np.where(zero[:, None], 0, levels).astype(np.int64)
    scale[zero] = 0
    step = scale.astype(F32)[:, None] * levels.astype(F32)
    codes = _rounded_again(blocks, _from_sub_blocks(codes, count), step, None, 16, -32, 31)
    codes[zero] = 0
    low = (codes & 15).reshape(count, 2, 2, 2, 32).swapaxes(2, 3)
    high = pack_bits((codes >> 4).reshape(count, 2, 4, 32), 2).reshape(count, 64)
    return np.concatenate([pack_bits(low, 4).reshape(count, 128), high, levels.astype(np.int8).view(np.uint8),
                           float16_bytes(scale)], axis=1)


def _six_bit_scales(blocks: np.ndarray, top: int, first_step: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's common part: the search on sub-blocks of 32 weighted by the sub-block's root
    mean square plus each value's magnitude, the 16-byte header (float16 scale and minimum, then
    twelve bytes of 6-bit sub-block scales and minimums) and the codes rounded onto them."""
    count = len(blocks)
    columns = _by_sub_block(blocks, 32)
    spread = np.sqrt((columns * columns).sum(axis=0) / F32(32))
    scales, minimums, codes = scale_and_minimum(columns, spread + np.abs(columns), top, first_step, 0.1, steps,
                                                absolute=False)
    scales, minimums = scales.reshape(count, 8), minimums.reshape(count, 8)
    largest_scale, largest_minimum = _largest(scales), _largest(minimums)
    scale_levels = np.minimum(_levels(scales, largest_scale, 63) & 0xFF, 63)
    minimum_levels = np.minimum(_levels(minimums, largest_minimum, 63) & 0xFF, 63)
    packed = np.concatenate([
        scale_levels[:, :4] | ((scale_levels[:, 4:] >> 4) << 6),
        minimum_levels[:, :4] | ((minimum_levels[:, 4:] >> 4) << 6),
        (scale_levels[:, 4:] & 15) | ((minimum_levels[:, 4:] & 15) << 4),
    ], axis=1)
    scale, minimum = as_float16(largest_scale / F32(63)), as_float16(largest_minimum / F32(63))
    step = scale.astype(F32)[:, None] * scale_levels.astype(F32)
    offset = minimum.astype(F32)[:, None] * minimum_levels.astype(F32)
    codes = _rounded_again(blocks, _from_sub_blocks(codes, count), step, offset, 32, 0, top)
    header = np.concatenate([float16_bytes(scale), float16_bytes(minimum), packed.astype(np.uint8)], axis=1)
    return header, codes


def _by_sub_block(blocks: np.ndarray, size: int) -> np.ndarray:
    """The values one sub-block of `size` a column: [size, sub-blocks]."""
    return np.ascontiguousarray(blocks.reshape(-1, size).T)


def _from_sub_blocks(codes: np.ndarray, count: int) -> np.ndarray:
    return codes.T.reshape(count, SUPER_BLOCK)


def _largest(values: np.ndarray) -> np.ndarray:
    """The largest value of each super-block's sub-blocks, 0 if none is positive."""
    return np.maximum(values.max(axis=1), F32(0))


def _levels(values: np.ndarray, largest: np.ndarray, top: int) -> np.ndarray:
    """Sub-block scales (or minimums) as whole numbers on `top` steps up to the super-block's largest
    (all 0 where that is 0), as int64."""
    with np.errstate(divide="ignore"):
        inverse = np.where(largest > 0, F32(top) / largest, F32(0))
    return nearest(inverse[:, None] * values).astype(np.int64)


def _rounded_again(blocks: np.ndarray, codes: np.ndarray, step: np.ndarray, offset: np.ndarray | None, size: int,
                   low: int, high: int) -> np.ndarray:
    """Each value rounded onto its sub-block's stored step (and offset), clipped to low..high and
    moved up by -low, as int64; a sub-block whose step is 0 keeps the search's `codes`."""
    count = len(blocks)
    values = blocks.reshape(count, -1, size)
    if offset is not None:
        values = values + offset[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rounded = np.clip(nearest(values / step[:, :, None]), low, high) - low
    kept = (step == 0)[:, :, None]
    return np.where(kept, codes.reshape(count, -1, size), rounded).reshape(count, SUPER_BLOCK).astype(np.int64)


def _two_bit_codes(codes: np.ndarray) -> np.ndarray:
    """2-bit codes of a super-block: byte 32h + l holds codes 128h + 32q + l in bits 2q, q = 0..3."""
    return pack_bits(codes.reshape(len(codes), 2, 4, 32), 2).reshape(len(codes), 64)
