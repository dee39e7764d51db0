"""A quantized KV cache's rows in numpy: what kv_cache.py's layout means, as code a backend may run on the host.

A row (one token's key or value in one KV head) of D values is stored as D one-byte codes, then its
float32 scale's 4 bytes, little-endian. "int8": scale = max|row| / 127, code = round(value / scale) in
-127..127. "fp8": scale = max|row| / 448, code = the nearest float8 e4m3fn value to value / scale, stored
as its bits. A row of zeros has scale 0 and codes 0. Rounding is to nearest, halfway cases to even.
"""

from __future__ import annotations

import numpy as np

from candelabra.core.contract.kv_cache import KV_SCALE_BYTES, KV_STORAGE_DTYPES

# The largest code magnitude of each quantized KV dtype: its scale maps a row's largest magnitude there.
KV_CODE_MAX = {"int8": 127.0, "fp8": 448.0}


def _e4m3fn_values() -> np.ndarray:
    """float8 e4m3fn's value for each of its 256 bit patterns (sign, 4 exponent bits biased by 7, 3
    mantissa bits; no infinities, and NaN where all exponent and mantissa bits are set)."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = sign * magnitude
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


FP8_E4M3_VALUES = _e4m3fn_values()
# The finite non-negative e4m3fn values in increasing order, and their bit patterns: the grid fp8 codes
# round to (sign apart).
_FP8_GRID_BITS = np.arange(0x7F)
_FP8_GRID = FP8_E4M3_VALUES[:0x7F]


def storage_kv_dtype(storage: str) -> str | None:
    """The quantized KV dtype whose cache tensors are of element type `storage` ("int8" or "uint8"), else None."""
    return next((kv for kv, stored in KV_STORAGE_DTYPES.items() if stored == storage), None)


def quantize_kv_rows(values: np.ndarray, kv_dtype: str) -> np.ndarray:
    """values [..., D] -> the stored rows [..., D + 4] in the cache's storage dtype."""
    rows = np.asarray(values, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = (np.abs(rows).max(axis=-1, keepdims=True) / np.float32(KV_CODE_MAX[kv_dtype])).astype(np.float32)
        scaled = np.where(scale > 0, rows / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    if kv_dtype == "int8":
        codes = np.clip(np.rint(np.nan_to_num(scaled)), -127, 127).astype(np.int8).view(np.uint8)
    else:
        codes = _nearest_e4m3_bits(scaled)
    scale_bytes = np.ascontiguousarray(scale.astype("<f4")).view(np.uint8).reshape(*rows.shape[:-1], KV_SCALE_BYTES)
    stored = np.concatenate([codes, scale_bytes], axis=-1)
    return stored.view(np.dtype(KV_STORAGE_DTYPES[kv_dtype]))


def dequantize_kv_rows(stored: np.ndarray, kv_dtype: str) -> np.ndarray:
    """The stored rows [..., D + 4] -> their values [..., D], float32."""
    stored = np.ascontiguousarray(stored)
    raw = stored.view(np.uint8)
    scale = raw[..., -KV_SCALE_BYTES:].copy().view("<f4")
    if kv_dtype == "int8":
        codes = raw[..., :-KV_SCALE_BYTES].view(np.int8).astype(np.float32)
    else:
        codes = FP8_E4M3_VALUES.astype(np.float32)[raw[..., :-KV_SCALE_BYTES]]
    return codes * scale


def _nearest_e4m3_bits(scaled: np.ndarray) -> np.ndarray:
    """The e4m3fn bits nearest each value (magnitudes within the grid; halfway cases to the even pattern; a
    negative value that rounds to zero to -0, as torch's conversion does)."""
    magnitude = np.minimum(np.nan_to_num(np.abs(scaled)), _FP8_GRID[-1])
    above = np.clip(np.searchsorted(_FP8_GRID, magnitude), 1, len(_FP8_GRID) - 1)
    low, high = _FP8_GRID[above - 1], _FP8_GRID[above]
    nearer_high = (high - magnitude < magnitude - low) | ((high - magnitude == magnitude - low) & (above % 2 == 0))
    bits = _FP8_GRID_BITS[np.where(nearer_high, above, above - 1)].astype(np.uint8)
    return np.where(np.signbit(scaled), bits | 0x80, bits).astype(np.uint8)
