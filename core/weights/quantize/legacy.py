"""GGML's first block formats, 32 values a block, as llama.cpp's reference quantizers
(quantize_row_q4_0_ref and its siblings) make them: one float16 scale (and a float16 minimum for
the _1 kinds) from the block's extremes, and each value rounded onto it.

Each function takes float32 blocks [count, 32] and returns their bytes, uint8 [count, block bytes],
laid out as ggml-common.h's block structs.
"""

from __future__ import annotations

import numpy as np

from candelabra.core.weights.quantize.block_math import (
    F32,
    first_largest_magnitude,
    float16_bytes,
    inverse_or_zero,
    pack_bits,
    round_away,
)


def q4_0(blocks: np.ndarray) -> np.ndarray:
    """Codes 0..15 on a scale that maps the value of largest magnitude to code 0: d * (q - 8)."""
    scale = first_largest_magnitude(blocks, axis=1) / F32(-8)
    codes = np.minimum(np.trunc(blocks * inverse_or_zero(scale)[:, None] + F32(8.5)), 15)
    return np.concatenate([float16_bytes(scale), _nibbles(codes)], axis=1)


def q4_1(blocks: np.ndarray) -> np.ndarray:
    """Codes 0..15 from the block's minimum up to its maximum: d * q + m."""
    low, scale, inverse = _range(blocks, 15)
    codes = np.minimum(np.trunc((blocks - low[:, None]) * inverse[:, None] + F32(0.5)), 15)
    return np.concatenate([float16_bytes(scale), float16_bytes(low), _nibbles(codes)], axis=1)


def q5_0(blocks: np.ndarray) -> np.ndarray:
    """Codes 0..31 on a scale that maps the value of largest magnitude to code 0: d * (q - 16)."""
    scale = first_largest_magnitude(blocks, axis=1) / F32(-16)
    codes = np.minimum(np.trunc(blocks * inverse_or_zero(scale)[:, None] + F32(16.5)), 31)
    return np.concatenate([float16_bytes(scale), _fifth_bits(codes), _nibbles(codes)], axis=1)


def q5_1(blocks: np.ndarray) -> np.ndarray:
    """Codes 0..31 from the block's minimum up to its maximum: d * q + m."""
    low, scale, inverse = _range(blocks, 31)
    codes = np.trunc((blocks - low[:, None]) * inverse[:, None] + F32(0.5))
    return np.concatenate([float16_bytes(scale), float16_bytes(low), _fifth_bits(codes), _nibbles(codes)], axis=1)


def q8_0(blocks: np.ndarray) -> np.ndarray:
    """Signed codes -127..127 on a scale that maps the largest magnitude to 127: d * q."""
    scale = np.max(np.abs(blocks), axis=1) / F32(127)
    codes = round_away(blocks * inverse_or_zero(scale)[:, None])
    return np.concatenate([float16_bytes(scale), codes.astype(np.int8).view(np.uint8)], axis=1)


def _range(blocks: np.ndarray, top_code: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's minimum, the scale from it to the maximum in `top_code` steps, and its inverse."""
    low, high = np.min(blocks, axis=1), np.max(blocks, axis=1)
    scale = (high - low) / F32(top_code)
    return low, scale, inverse_or_zero(scale)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """The low four bits of 32 codes a block: code j in the low half of byte j, code j + 16 in its high half."""
    return pack_bits(codes.reshape(len(codes), 2, 16).astype(np.uint8) & np.uint8(15), 4)


def _fifth_bits(codes: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 codes, as a little-endian uint32 whose bit j is code j's."""
    high = (codes.astype(np.uint8) >> np.uint8(4)).reshape(len(codes), 4, 8)
    return pack_bits(high.swapaxes(1, 2), 1)
