"""Attention of a step's decodes over the paged cache, and the rotary embedding with the cache write
before it, in C (csrc/decode_attention.c): one call a layer where a step holds decodes alone.

In torch ops a decode's attention (gather the blocks, two matmuls around a softmax, masks, copies) is
some twenty small ops a layer, about 140 us for one sequence of 100 tokens on 2 cores, and the rotary
embedding with the cache write another 100, nearly all of it the ops' own cost; the C kernel reads
each key and value once, in place, for the query heads that share it (about 12 us). It serves
float32, bfloat16 and float16 caches on the CPU, attending in float32; an int8 cache, another device
or a machine where the library was not built keeps the torch path. The rotary embedding rounds as
torch's does, so a key is cached the same whichever path rotated it.
"""

from __future__ import annotations

import torch

from candelabra.backends.torch.cpu import kernel_abi
from candelabra.backends.torch.cpu.kernel_library import kernels
from candelabra.core.contract.ops import KVCache

_DTYPE_CODES = {getattr(torch, name): code for name, code in kernel_abi.DTYPE_CODES.items()}
_STYLES = {"neox": 0, "gptj": 1}


def native_decode_attention_available() -> tuple[bool, str]:
    """Whether the kernel library is loaded here, and what it is or why not; never raises."""
    loaded = kernels()
    return loaded.library is not None, loaded.detail


def reads_natively(cache: KVCache) -> bool:
    """Whether `decode_attention` reads this cache: a float one on the CPU, laid out as allocated, where the
    library is built."""
    key, value = cache
    return (key.device.type == "cpu" and key.dtype in _DTYPE_CODES and value.dtype == key.dtype
            and key.shape == value.shape and key.is_contiguous() and value.is_contiguous()
            and kernels().library is not None)


def decode_attention(q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None, logit_softcap: float | None) -> torch.Tensor:
    """Each sequence's one query q [R, Hq, D] (at position seq_lens[r] - 1) over its cached keys: [R, Hq, D]
    float32, as `Ops.paged_attention` defines it. block_tables [R, W] and seq_lens [R] are int64; the cache
    must satisfy `reads_natively`."""
    key, value = cache
    blocks, block_size, kv_heads, head_dim = key.shape
    rows, heads = q.shape[0], q.shape[1]
    if q.shape[2] != head_dim or heads % kv_heads:
        raise ValueError(f"queries {list(q.shape)} do not fit a cache of {kv_heads} KV heads of {head_dim}")
    q = q.to(torch.float32).contiguous()
    tables, limits, _keep = _attention_arguments(rows, block_tables, seq_lens, sliding_window, logit_softcap)
    out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
    _checked(kernels().library.decode_attention(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), _DTYPE_CODES[key.dtype], blocks, block_size, *tables, rows,
        heads, kv_heads, head_dim, scale, *limits, out.data_ptr(), torch.get_num_threads()),
        "decode attention")
    return out


def _attention_arguments(rows: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None,
                         logit_softcap: float | None = None) -> tuple:
    """(block tables, their width, lengths) and (soft cap, window) as the C entry points take them, and the
    tensors whose memory they point at, to keep alive through the call."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"a sliding window holds at least one key, got {sliding_window}")
    tables = block_tables.to(torch.int64).contiguous()
    lengths = seq_lens.reshape(-1).to(torch.int64).contiguous()
    if tables.shape[0] != rows or lengths.shape[0] != rows:
        raise ValueError(f"{rows} queries need {rows} block tables and lengths, got {tables.shape[0]} and "
                         f"{lengths.shape[0]}")
    return ((tables.data_ptr(), tables.shape[1], lengths.data_ptr()), (logit_softcap or 0.0, sliding_window or 0),
            (tables, lengths))


def _checked(status: int, what: str) -> None:
    if status:
        raise ValueError(f"{what}: {kernel_abi.status_message(status, kernel_abi.ATTENTION_STATUSES)}")


def rotates_natively(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, cache: KVCache) -> bool:
    """Whether `rotary_and_write` takes these: q [T, Hq, D], k and v [T, Hk, D] in the cache's dtype, each
    head's values contiguous, a float32 table, and a cache `reads_natively`."""
    key = cache.key
    return (reads_natively(cache) and q.dtype == k.dtype == v.dtype == key.dtype
            and cos_sin.dtype == torch.float32 and cos_sin.device.type == "cpu" and cos_sin.is_contiguous()
            and cos_sin.dim() == 2 and q.dim() == 3 and q.shape[2] == key.shape[3]
            and k.shape[1:] == v.shape[1:] == key.shape[2:] and q.shape[0] == k.shape[0] == v.shape[0]
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)))


def _rotary_arguments(q, k, v, table_rows, cos_sin, cache, slots, style) -> tuple:
    if style not in _STYLES:
        raise ValueError(f"unknown rotary style {style!r}; expected 'neox' or 'gptj'")
    key, value = cache
    rows, slots = table_rows.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    if rows.shape != (q.shape[0],) or slots.shape != (q.shape[0],):
        raise ValueError(f"{q.shape[0]} tokens need {q.shape[0]} table rows and slots, got {list(rows.shape)} and "
                         f"{list(slots.shape)}")
    return ((q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), _DTYPE_CODES[key.dtype],
             rows.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0], cos_sin.shape[1], _STYLES[style],
             slots.data_ptr(), key.data_ptr(), value.data_ptr(), key.shape[0], key.shape[1]), (rows, slots))


def rotary_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table_rows: torch.Tensor,
                     cos_sin: torch.Tensor, cache: KVCache, slots: torch.Tensor, style: str) -> torch.Tensor:
    """`Ops.rotary_and_write_kv` for inputs that `rotates_natively`: writes the cache in place and returns the
    rotated q [T, Hq, D] in q's dtype."""
    arguments, _keep = _rotary_arguments(q, k, v, table_rows, cos_sin, cache, slots, style)
    out = torch.empty(q.shape, dtype=q.dtype)
    _checked(kernels().library.rotary_and_write(q.shape[0], *arguments, q.shape[1], k.shape[1], q.shape[2],
                                                       out.data_ptr(), torch.get_num_threads()),
             "rotary and cache write")
    return out


def rotary_and_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table_rows: torch.Tensor,
                                cos_sin: torch.Tensor, cache: KVCache, slots: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                                logit_softcap: float | None, style: str) -> torch.Tensor:
    """`rotary_and_write`, then `decode_attention` of the rotated queries, in one call, for a step of decodes
    alone (token r is sequence r's query): [R, Hq, D] float32."""
    arguments, _keep = _rotary_arguments(q, k, v, table_rows, cos_sin, cache, slots, style)
    rows, heads, head_dim = q.shape
    tables, limits, _keep_too = _attention_arguments(rows, block_tables, seq_lens, sliding_window, logit_softcap)
    out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
    _checked(kernels().library.rotary_and_decode_attention(
        *arguments, *tables, rows, heads, k.shape[1], head_dim, scale, *limits, out.data_ptr(),
        torch.get_num_threads()), "rotary and decode attention")
    return out
