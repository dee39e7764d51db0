"""Compute dtypes by name.

Backends hold tensors in their own types, so the core names dtypes with plain strings. numpy has
no bfloat16: `Backend.to_host` returns such data as float32.
"""

from __future__ import annotations

from typing import Literal

DType = Literal["float32", "float16", "bfloat16"]

FLOAT_DTYPES: tuple[DType, ...] = ("float32", "float16", "bfloat16")


def check_dtype(name: str) -> DType:
    """Return `name` if it is a known compute dtype, else raise a ValueError listing them."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(FLOAT_DTYPES)}")
    return name  # type: ignore[return-value]

