"""A quantized KV cache's rows in torch (core/contract/kv_quantization.py has the layout): each row's
codes, then its float32 scale's bytes, in an int8 ("int8") or uint8 ("fp8", e4m3fn bits) tensor.
write_kv quantizes the rows it stores; attention dequantizes only the blocks a step gathers."""

from __future__ import annotations

import torch

from candelabra.core.contract.kv_cache import KV_SCALE_BYTES
from candelabra.core.contract.kv_quantization import KV_CODE_MAX

_KV_DTYPE_OF_STORAGE = {torch.int8: "int8", torch.uint8: "fp8"}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _KV_DTYPE_OF_STORAGE


def quantize_rows(rows: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """rows [..., D] -> [..., D + 4] in `storage`: codes rounded to nearest (halfway to even), then the scale."""
    kv_dtype = _KV_DTYPE_OF_STORAGE[storage]
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / KV_CODE_MAX[kv_dtype]
    scaled = torch.where(scale > 0, x / scale, 0.0)
    if kv_dtype == "int8":
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    # The host and every device torch runs on are little-endian, as the layout's scale bytes are.
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1).view(storage)


def dequantize_rows(stored: torch.Tensor) -> torch.Tensor:
    """stored [..., D + 4] (any strides) -> its values [..., D], float32 and contiguous."""
    dim = stored.shape[-1] - KV_SCALE_BYTES
    raw = stored.view(torch.uint8)
    scale = raw[..., dim:].contiguous().view(torch.float32)
    codes = raw[..., :dim].view(torch.int8 if stored.dtype == torch.int8 else torch.float8_e4m3fn)
    return codes.to(torch.float32, memory_format=torch.contiguous_format).mul_(scale)
