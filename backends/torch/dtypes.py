"""The torch dtype of each dtype name the contract speaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> torch.dtype:
    """A compute dtype's torch dtype, or a quantized KV cache's storage dtype's ("int8", "uint8"). torch is
    imported here, not above, so that a backend module names this function where torch is missing, and its
    probe says so."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
            "uint8": torch.uint8}[name]
