"""Compute dtypes by name.

Backends hold tensors in their own types, so the core names dtypes with plain strings. numpy has
no bfloat16: `Backend.to_host` returns such data as float32.
"""

from __future__ import annotations

from typing import Literal

DType = Literal["float32", "float16", "bfloat16"]

FLOAT_DTYPES: tuple[DType, ...] = ("float32", "float16", "bfloat16")


# A KV cache may also be kept quantized, one scale per cached row (a token's key or value in one KV
# head): "int8" (codes -127..127, value = code * scale) or "fp8" (float8 e4m3 codes, value = code *
# scale). kv_cache.py says how such a row is laid out.
KVDType = Literal["float32", "float16", "bfloat16", "int8", "fp8"]

QUANTIZED_KV_DTYPES: tuple[KVDType, ...] = ("int8", "fp8")
KV_DTYPES: tuple[KVDType, ...] = (*FLOAT_DTYPES, *QUANTIZED_KV_DTYPES)


def check_kv_dtype(name: str) -> KVDType:
    """Return `name` if a KV cache can be kept in it, else raise a ValueError listing them."""
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
    return name  # type: ignore[return-value]


def check_dtype(name: str) -> DType:
    """Return `name` if it is a known compute dtype, else raise a ValueError listing them."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(FLOAT_DTYPES)}")
    return name  # type: ignore[return-value]

