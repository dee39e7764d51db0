"""Rotary embedding and the paged KV-cache write as Triton kernels, apart and fused.

`rotary` is `Ops.rotary`; `write_kv` scatters K/V rows into the cache in place, skipping NO_SLOT
on the device; `rotary_write_kv` does both in one launch, writing the rotated k (and v) into the
cache as it goes. A quantized cache ("int8", "fp8": kv_codes.py) gets each row's codes and scale from
the program that holds the whole row, in the same launch. Nothing here reads device data on the host,
and launch grids depend only on shapes, so every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.kernels import kv_codes
from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options
from candelabra.backends.cuda.kernels.kv_codes import FLOAT_CACHE, check_same_codes, row_features

STYLES = ("neox", "gptj")
# A kernel that rotates as it loads (paged attention's decode tiles) takes the style as a constexpr.
NO_ROTARY = tl.constexpr(0)
STYLE_KINDS = {"neox": 1, "gptj": 2}
NEOX_KIND = tl.constexpr(STYLE_KINDS["neox"])
# Largest [heads, features] tile one program holds: 16 float32 values per thread with 4 warps.
TILE_ELEMENTS = 2048


@triton.jit
def _row_starts(cache_ptr, slot, heads, stride_block, stride_offset, stride_head, block_size):
    """Where the rows [heads] of cache slot `slot` (int64) start."""
    # Clamped so that a NO_SLOT token, whose stores are masked off, still forms in-range addresses.
    safe_slot = tl.maximum(slot, 0)
    return cache_ptr + (safe_slot // block_size) * stride_block + (safe_slot % block_size) * stride_offset \
        + heads * stride_head


@triton.jit
def _write_heads(rows, slot, cols, values, mask, scales, CODES: tl.constexpr):
    """Store values [heads, cols] at columns `cols` of the rows [heads] (as codes of their rows' scales
    [heads] in a quantized cache), unless the slot is NO_SLOT (< 0)."""
    if CODES == "none":
        stored = values.to(rows.dtype.element_ty)
    else:
        stored = kv_codes.encode(values.to(tl.float32), scales, CODES)
    tl.store(rows[:, None] + cols[None, :], stored, mask=mask & (slot >= 0))


@triton.jit
def _scales_for(rows, slot, largest, features, head_valid, CODES: tl.constexpr):
    """In a quantized cache, the scales of rows [heads] whose largest magnitudes are `largest`, stored after
    their `features` codes (unless the slot is NO_SLOT); in a float cache nothing (0.0)."""
    scales = 0.0
    if CODES != "none":
        scales = kv_codes.scales_of_largest(largest, CODES)
        kv_codes.store_scales(rows + features, scales, head_valid & (slot >= 0))
    return scales


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_heads,
    head_dim,
    value_dim,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    key_cache_stride_block,
    key_cache_stride_offset,
    key_cache_stride_head,
    value_cache_stride_block,
    value_cache_stride_offset,
    value_cache_stride_head,
    block_size,
    BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    CODES: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    begin(DEPENDENT)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    head_mask = head_valid[:, None]
    slot = tl.load(slot_ptr + token).to(tl.int64)

    cols = tl.arange(0, D_PAD)
    mask = head_mask & (cols[None, :] < head_dim)
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + cols[None, :], mask=mask, other=0.0)
    rows = _row_starts(key_cache_ptr, slot, heads, key_cache_stride_block, key_cache_stride_offset,
                       key_cache_stride_head, block_size)
    scales = _scales_for(rows, slot, kv_codes.largest_magnitudes(key), head_dim, head_valid, CODES)
    _write_heads(rows, slot, cols, key, mask, scales, CODES)

    cols = tl.arange(0, DV_PAD)
    mask = head_mask & (cols[None, :] < value_dim)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + cols[None, :], mask=mask,
                    other=0.0)
    rows = _row_starts(value_cache_ptr, slot, heads, value_cache_stride_block, value_cache_stride_offset,
                       value_cache_stride_head, block_size)
    scales = _scales_for(rows, slot, kv_codes.largest_magnitudes(value), value_dim, head_valid, CODES)
    _write_heads(rows, slot, cols, value, mask, scales, CODES)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, src_stride_h, dst_stride_h, heads, cols_a, cols_b, mask, cos, sin,
                  STORE: tl.constexpr = True):
    """Rotate pairs (a, b) of heads [BLOCK_H] of one token, store them in dst (unless STORE is False),
    and return them rounded to dst's dtype."""
    src = src_ptr + heads[:, None] * src_stride_h
    dst = dst_ptr + heads[:, None] * dst_stride_h
    a = tl.load(src + cols_a[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + cols_b[None, :], mask=mask, other=0.0).to(tl.float32)
    new_a = (a * cos[None, :] - b * sin[None, :]).to(dst_ptr.dtype.element_ty)
    new_b = (b * cos[None, :] + a * sin[None, :]).to(dst_ptr.dtype.element_ty)
    if STORE:
        tl.store(dst + cols_a[None, :], new_a, mask=mask)
        tl.store(dst + cols_b[None, :], new_b, mask=mask)
    return new_a, new_b


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_q_heads,
    num_k_heads,
    head_dim,
    half_rotary,
    value_dim,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    q_out_stride_t,
    q_out_stride_h,
    k_out_stride_t,
    k_out_stride_h,
    cos_sin_stride,
    value_stride_t,
    value_stride_h,
    key_cache_stride_block,
    key_cache_stride_offset,
    key_cache_stride_head,
    value_cache_stride_block,
    value_cache_stride_offset,
    value_cache_stride_head,
    block_size,
    NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    WRITE_KV: tl.constexpr,
    CODES: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    begin(DEPENDENT)
    # Axis 1 enumerates blocks of q heads, then blocks of k heads (which also carry v to the cache).
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)

    pairs = tl.arange(0, HALF_PAD)
    pair_mask = pairs < half_rotary
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + half_rotary + pairs, mask=pair_mask, other=0.0)
    sin = sin.to(tl.float32)
    if NEOX:
        cols_a = pairs
        cols_b = pairs + half_rotary
    else:
        cols_a = 2 * pairs
        cols_b = 2 * pairs + 1
    pass_cols = 2 * half_rotary + tl.arange(0, PASS_PAD)
    pass_col_mask = pass_cols[None, :] < head_dim

    if head_block < q_blocks:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads[:, None] < num_q_heads
        src = q_ptr + token * q_stride_t
        dst = q_out_ptr + token * q_out_stride_t
        _rotate_heads(src, dst, q_stride_h, q_out_stride_h, heads, cols_a, cols_b,
                      head_mask & pair_mask[None, :], cos, sin)
        if HAS_PASS:
            rest = tl.load(src + heads[:, None] * q_stride_h + pass_cols[None, :], mask=head_mask & pass_col_mask)
            tl.store(dst + heads[:, None] * q_out_stride_h + pass_cols[None, :], rest, mask=head_mask & pass_col_mask)
    else:
        heads = (head_block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_valid = heads < num_k_heads
        head_mask = head_valid[:, None]
        src = k_ptr + token * k_stride_t
        dst = k_out_ptr + token * k_out_stride_t
        slot = tl.load(slot_ptr + token).to(tl.int64)
        mask = head_mask & pair_mask[None, :]
        # With the cache write, the rotated k goes to the cache alone: no caller reads it back.
        new_a, new_b = _rotate_heads(src, dst, k_stride_h, k_out_stride_h, heads, cols_a, cols_b, mask, cos, sin,
                                     not WRITE_KV)
        largest = tl.maximum(kv_codes.largest_magnitudes(new_a), kv_codes.largest_magnitudes(new_b))
        pass_mask = head_mask & pass_col_mask
        if HAS_PASS:
            rest = tl.load(src + heads[:, None] * k_stride_h + pass_cols[None, :], mask=pass_mask, other=0.0)
            largest = tl.maximum(largest, kv_codes.largest_magnitudes(rest))
            if not WRITE_KV:
                tl.store(dst + heads[:, None] * k_out_stride_h + pass_cols[None, :], rest, mask=pass_mask)
        if WRITE_KV:
            rows = _row_starts(key_cache_ptr, slot, heads, key_cache_stride_block, key_cache_stride_offset,
                               key_cache_stride_head, block_size)
            scales = _scales_for(rows, slot, largest, head_dim, head_valid, CODES)
            _write_heads(rows, slot, cols_a, new_a, mask, scales, CODES)
            _write_heads(rows, slot, cols_b, new_b, mask, scales, CODES)
            if HAS_PASS:
                _write_heads(rows, slot, pass_cols, rest, pass_mask, scales, CODES)

            value_cols = tl.arange(0, DV_PAD)
            mask = head_mask & (value_cols[None, :] < value_dim)
            value_src = value_ptr + token * value_stride_t + heads[:, None] * value_stride_h
            value = tl.load(value_src + value_cols[None, :], mask=mask, other=0.0)
            rows = _row_starts(value_cache_ptr, slot, heads, value_cache_stride_block, value_cache_stride_offset,
                               value_cache_stride_head, block_size)
            scales = _scales_for(rows, slot, kv_codes.largest_magnitudes(value), value_dim, head_valid, CODES)
            _write_heads(rows, slot, value_cols, value, mask, scales, CODES)


@triton.jit
def head_rotation(position, cos_sin_ptr, cos_sin_stride, dims, STYLE: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """How a head's features `dims` rotate at `position` (`Ops.rotary` with a table of ROTARY_DIM columns, in
    style STYLE_KINDS): (each feature's partner in its pair, the cos to multiply it by, and the signed sin to
    multiply its partner by), so that `rotate` gives a in the pair's a*c - b*s and b its b*c + a*s; features
    past ROTARY_DIM pass through (cos 1, sin 0)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    rotating = dims < ROTARY_DIM
    if STYLE == NEOX_KIND:
        first = dims < HALF
        pair = tl.where(first, dims, dims - HALF)
        partner = tl.where(first, dims + HALF, dims - HALF)
    else:
        first = dims % 2 == 0
        pair = dims // 2
        partner = dims ^ 1
    row = cos_sin_ptr + position.to(tl.int64) * cos_sin_stride
    cos = tl.load(row + pair, mask=rotating, other=1.0).to(tl.float32)
    sin = tl.load(row + HALF + pair, mask=rotating, other=0.0).to(tl.float32)
    return tl.where(rotating, partner, dims), tl.where(rotating, cos, 1.0), tl.where(first, -sin, sin)


@triton.jit
def rotate(rows, dims, partner, cos, sin, mask, ROTARY_DIM: tl.constexpr):
    """Features `dims` of the rows at `rows` [R] rotated as `head_rotation` says, in float32 (0 where masked)."""
    x = tl.load(rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    mate = tl.load(rows[:, None] + partner[None, :], mask=mask & (dims < ROTARY_DIM)[None, :], other=0.0)
    return x * cos[None, :] + mate.to(tl.float32) * sin[None, :]


def _last_axis_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _heads_per_program(num_heads: int, widest_tile: int) -> int:
    return min(triton.next_power_of_2(max(num_heads, 1)), max(1, TILE_ELEMENTS // widest_tile))


def _check_cache(key_cache, value_cache, key, value) -> str:
    """The caches' codes (kv_codes.py), once their shapes are checked against the rows written."""
    codes = check_same_codes(key_cache, value_cache)
    for name, cache, rows in (("key", key_cache, key), ("value", value_cache, value)):
        if cache.dim() != 4 or cache.shape[2] != rows.shape[1] or row_features(cache) != rows.shape[2]:
            scale = " + 4 scale bytes" if codes != FLOAT_CACHE else ""
            raise ValueError(f"{name} cache {tuple(cache.shape)} is not "
                             f"[num_blocks, block_size, {rows.shape[1]}, {rows.shape[2]}{scale}]")
        if cache.stride(-1) != 1:
            raise ValueError(f"the {name} cache's last axis must be contiguous (it is written in place)")
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError(
            f"key cache {tuple(key_cache.shape)} and value cache {tuple(value_cache.shape)} differ in blocks"
        )
    return codes


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key and value [T, Hk, D] into the caches [num_blocks, block_size, Hk, D] in place:
    token t at slot slot_mapping[t] (int32 or int64), none where it is -1 (NO_SLOT), each cast to
    its cache's dtype, or quantized row by row into a quantized cache's [.., D + 4] bytes."""
    key, value = _last_axis_dense(key), _last_axis_dense(value)
    codes = _check_cache(key_cache, value_cache, key, value)
    num_tokens, num_heads, head_dim = key.shape
    if slot_mapping.shape != (num_tokens,) or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping {tuple(slot_mapping.shape)} disagree"
        )
    if num_tokens == 0 or num_heads == 0:
        return
    d_pad, dv_pad = triton.next_power_of_2(head_dim), triton.next_power_of_2(value.shape[2])
    block_h = _heads_per_program(num_heads, max(d_pad, dv_pad))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        num_heads,
        head_dim,
        value.shape[2],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
        key_cache.shape[1],
        BLOCK_H=block_h,
        D_PAD=d_pad,
        DV_PAD=dv_pad,
        CODES=codes,
        **launch_options(key.device),
    )


def _rotary(q, k, positions, cos_sin, style, value=None, key_cache=None, value_cache=None, slot_mapping=None):
    if style not in STYLES:
        raise ValueError(f"unknown rotary style {style!r}; expected 'neox' or 'gptj'")
    q, k = _last_axis_dense(q), _last_axis_dense(k)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rotary_dim = cos_sin.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} disagree")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary dim {rotary_dim} must be even and at most the head dim {head_dim}")
    write = value is not None
    codes = FLOAT_CACHE
    if write:
        value = _last_axis_dense(value)
        codes = _check_cache(key_cache, value_cache, k, value)
        if value.shape[:2] != k.shape[:2] or slot_mapping.shape != (num_tokens,):
            raise ValueError(
                f"k {tuple(k.shape)}, v {tuple(value.shape)} and slot_mapping {tuple(slot_mapping.shape)} disagree"
            )

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # with the cache write the kernel stores no k of its own (k stands in, for its dtype and strides)
    k_out = k if write else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos_sin = _last_axis_dense(cos_sin)
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(max(half, 1))
    pass_pad = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    dv_pad = triton.next_power_of_2(value.shape[2]) if write else 1
    block_h = _heads_per_program(min(num_q_heads, num_k_heads), max(half_pad, pass_pad, dv_pad))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    # Without a cache write the cache arguments are never written and the slot (read, then unused)
    # comes from positions: any tensors of the right kinds do.
    value_arg = value if write else k
    key_cache_arg, value_cache_arg = (key_cache, value_cache) if write else (k_out, k_out)
    slot_arg = slot_mapping.contiguous() if write else positions
    _rotary_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        positions.contiguous(),
        cos_sin,
        value_arg,
        key_cache_arg,
        value_cache_arg,
        slot_arg,
        num_q_heads,
        num_k_heads,
        head_dim,
        half,
        value.shape[2] if write else 0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin.stride(0),
        value_arg.stride(0),
        value_arg.stride(1),
        *(_cache_strides(key_cache) if write else (0, 0, 0)),
        *(_cache_strides(value_cache) if write else (0, 0, 0)),
        key_cache.shape[1] if write else 1,
        NEOX=style == "neox",
        BLOCK_H=block_h,
        HALF_PAD=half_pad,
        HAS_PASS=rotary_dim < head_dim,
        PASS_PAD=pass_pad,
        DV_PAD=dv_pad,
        WRITE_KV=write,
        CODES=codes,
        **launch_options(q.device),
    )
    return q_out, k_out


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, style: str = "neox"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] at positions [T] (int32 or int64) by the rows of the
    cos_sin table [max_positions, R] float32; features past R pass through. Returns new (q, k)."""
    return _rotary(q, k, positions, cos_sin, style)


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    style: str,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary`, and in the same launch `write_kv` of the rotated k and of v. Returns q rotated; the rotated
    k is only in the cache."""
    q_out, _ = _rotary(q, k, positions, cos_sin, style, v, key_cache, value_cache, slot_mapping)
    return q_out
