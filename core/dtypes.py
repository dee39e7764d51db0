"""Compute dtypes by name.

Backends hold tensors in their own types, so the core names dtypes with plain strings. numpy has
no bfloat16: on the host such data travels as float32.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DType = Literal["float32", "float16", "bfloat16"]

FLOAT_DTYPES: tuple[DType, ...] = ("float32", "float16", "bfloat16")

_HOST_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}


def check_dtype(name: str) -> DType:
    """Return `name` if it is a known compute dtype, else raise a ValueError listing them."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(FLOAT_DTYPES)}")
    return name  # type: ignore[return-value]


def host_dtype(name: DType) -> np.dtype:
    """The numpy dtype that carries values of compute dtype `name` on the host."""
    return np.dtype(_HOST_DTYPES[check_dtype(name)])
