"""The float32 steps GGML's reference quantizers are built from, as numpy on many blocks at once.

Every step rounds as the C code does in single precision, so the same input gives the same bytes:
products and quotients of float32 arrays, `nearest` for llama.cpp's nearest_int (the magic-number
trick, which rounds half to even), `round_away` for C's roundf, and float16 scales rounded to
nearest even. Sums over a block run one value after another, as the C loops add them, by keeping
the values of a block in a column: the arrays the k-quant searches take are [values, blocks], and
numpy adds the rows of such an array in order.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def nearest(values: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: to the nearest whole number, half to even (still float32)."""
    return np.rint(values)


def round_away(values: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest whole number, half away from zero (float32). Exact, where adding
    0.5 would round up the largest float below a half."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    whole += magnitude - whole >= F32(0.5)
    return np.copysign(whole, values)


def inverse_or_zero(scale: np.ndarray) -> np.ndarray:
    """1 / scale, and 0 where the scale is 0 (a block of zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(scale != 0, F32(1) / scale, F32(0)).astype(F32)


def first_largest_magnitude(values: np.ndarray, axis: int) -> np.ndarray:
    """The signed value of largest magnitude along `axis`, the first one where several tie: the C
    loops keep a new maximum only when it is strictly larger."""
    index = np.expand_dims(np.argmax(np.abs(values), axis=axis), axis)
    return np.take_along_axis(values, index, axis=axis).squeeze(axis)


def as_float16(values: np.ndarray) -> np.ndarray:
    """GGML's float32 to float16: nearest, ties to even."""
    return values.astype(np.float16)


def float16_bytes(values: np.ndarray) -> np.ndarray:
    """Each value as a float16's two little-endian bytes: uint8 [count, 2]."""
    return as_float16(values).astype("<f2").view(np.uint8).reshape(-1, 2)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes of `bits` bits each, [..., k, width], packed k to a byte, code i in bits i * `bits` up:
    uint8 [..., width]."""
    codes = codes.astype(np.uint8)
    packed = np.zeros(codes.shape[:-2] + codes.shape[-1:], np.uint8)
    for place in range(codes.shape[-2]):
        packed |= codes[..., place, :] << np.uint8(place * bits)
    return packed
