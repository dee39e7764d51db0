"""A quantized KV cache's rows in Triton: how the cache write encodes them and attention decodes them.

A row (one token's key or value in one KV head) is its D codes, one byte each, then its float32 scale's
4 bytes, little-endian (core/contract/kv_cache.py): "int8" caches hold signed codes (int8 tensors),
value = code * scale with scale = max|row| / 127; "fp8" caches hold float8 e4m3fn bits (uint8 tensors),
value = code * scale with scale = max|row| / 448. A row of zeros has scale 0 and codes 0. Both round to
nearest, halfway cases to even, by exact integer and float steps rather than a conversion instruction: the
interpreter's float32 -> float8e4nv cast drops the carry of a rounded-up mantissa (127.4 became 64), and
these steps give the same bytes on every GPU and under the interpreter. A negative value that rounds to
zero is stored as +0. Reading decodes fp8 bits through tl.float8e4nv, which needs sm_89 or later.

The scale is read and written a byte at a time, so a row needs no alignment (head dims that are not a
multiple of 4 work too). Kernels get the codes as a constexpr string, "none" for a float cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from candelabra.core.contract.kv_cache import KV_SCALE_BYTES

CACHE_CODES = {torch.int8: "int8", torch.uint8: "fp8"}
FLOAT_CACHE = "none"
# 2^-6, e4m3's smallest normal value: below it codes are multiples of 2^-9.
_FP8_MIN_NORMAL = tl.constexpr(0.015625)


def cache_codes(cache: torch.Tensor) -> str:
    """What the cache's rows hold: "int8" or "fp8" codes with a scale, or FLOAT_CACHE."""
    return CACHE_CODES.get(cache.dtype, FLOAT_CACHE)


def row_features(cache: torch.Tensor) -> int:
    """The values in one of the cache's rows: its last axis, less the scale's bytes when quantized."""
    return cache.shape[-1] - (KV_SCALE_BYTES if cache.dtype in CACHE_CODES else 0)


def check_same_codes(key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The codes both caches hold; a ValueError where one is quantized and the other is not, or differently."""
    codes = cache_codes(key_cache)
    if codes != cache_codes(value_cache) or (codes != FLOAT_CACHE and key_cache.dtype != value_cache.dtype):
        raise ValueError(f"the key cache ({key_cache.dtype}) and value cache ({value_cache.dtype}) must be "
                         f"quantized alike")
    return codes


@triton.jit
def scales_of_largest(largest, CODES: tl.constexpr):
    """The scales of rows whose largest magnitudes are `largest` [rows] (float32)."""
    return tl.div_rn(largest, tl.full(largest.shape, 127.0 if CODES == "int8" else 448.0, tl.float32))


@triton.jit
def largest_magnitudes(values):
    """max |value| of each row of values [rows, cols], float32 (masked-off values loaded as 0)."""
    return tl.max(tl.abs(values.to(tl.float32)), 1)


def row_alignment(*caches: torch.Tensor) -> int:
    """What the rows of these caches start at multiples of, in elements, as far as a kernel is to be told:
    4 for quantized rows a whole number of words apart in word-aligned memory (codes of a head dim that
    is a multiple of 4), so that their codes load 4 to an instruction rather than a byte at a time (which
    took a pointer register pair per byte, every register, and spilled kilobytes); else 1, which tells
    nothing. A kernel takes the strides in those units (`row_strides`) and multiplies the row offsets by
    the alignment, a constexpr, which is how Triton learns it (tl.multiple_of on the offsets was lost)."""
    quantized_words = all(cache.dtype in CACHE_CODES and cache.data_ptr() % 4 == 0
                          and all(stride % 4 == 0 for stride in cache.stride()[:-1]) for cache in caches)
    return 4 if quantized_words else 1


def row_strides(cache: torch.Tensor, alignment: int) -> tuple[int, int, int]:
    """The cache's block, slot and head strides in units of `alignment` elements."""
    return cache.stride(0) // alignment, cache.stride(1) // alignment, cache.stride(2) // alignment


@triton.jit
def row_scales(values, CODES: tl.constexpr):
    """The scale of each row of values [rows, cols]."""
    return scales_of_largest(largest_magnitudes(values), CODES)


@triton.jit
def _round_half_even(x):
    """x rounded to the nearest whole number, halfway cases to even, as int32 (|x| < 2^31)."""
    whole = x.to(tl.int32)  # toward zero
    fraction = tl.abs(x - whole.to(tl.float32))  # exact
    up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) != 0))
    return whole + tl.where(up, tl.where(x < 0, -1, 1), 0)


@triton.jit
def encode(values, scales, CODES: tl.constexpr):
    """values [rows, cols] (float32) as codes of their rows' scales [rows], in the cache's element type."""
    values, divisors = tl.broadcast(values, tl.where(scales > 0, scales, 1.0)[:, None])
    scaled = tl.div_rn(values, divisors)  # a zero row's values are zeros
    if CODES == "int8":
        codes = tl.minimum(tl.maximum(_round_half_even(scaled), -127), 127).to(tl.int8)
    else:
        magnitude = tl.minimum(tl.abs(scaled), 448.0)
        # a normal value: round float32's 23 mantissa bits to e4m3's 3 (a carry moves into the exponent),
        # then rebias the exponent from 127 to 7: (exponent << 3 | mantissa) - (120 << 3)
        bits = magnitude.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
        subnormal = _round_half_even(magnitude * 512.0)
        code = tl.where(magnitude < _FP8_MIN_NORMAL, subnormal, normal)
        sign = tl.where((scaled < 0) & (code != 0), 0x80, 0)
        codes = (code | sign).to(tl.uint8)
    return codes


@triton.jit
def decode(codes, CODES: tl.constexpr):
    """The codes' values before scaling, float32."""
    if CODES == "fp8":
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        values = codes.to(tl.float32)
    return values


@triton.jit
def store_scales(scale_ptrs, scales, mask):
    """Store each row's scale [rows] at scale_ptrs [rows] (the byte after its codes), little-endian."""
    bits = scales.to(tl.int32, bitcast=True)
    for byte in tl.static_range(4):
        value = ((bits >> (8 * byte)) & 0xFF).to(tl.uint8)
        tl.store(scale_ptrs + byte, value.to(scale_ptrs.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def load_scales(scale_ptrs, mask, ALIGNMENT: tl.constexpr = 1):
    """Each row's scale [rows] from scale_ptrs [rows]; 0 where masked off. With ALIGNMENT 4 (row_alignment)
    the scales are word-aligned and load as words."""
    if ALIGNMENT % 4 == 0:
        scales = tl.load(scale_ptrs.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    else:
        bits = tl.zeros(scale_ptrs.shape, tl.int32)
        for byte in tl.static_range(4):
            raw = tl.load(scale_ptrs + byte, mask=mask, other=0).to(tl.uint8, bitcast=True)
            bits = bits | (raw.to(tl.int32) << (8 * byte))
        scales = bits.to(tl.float32, bitcast=True)
    return scales
