"""Paged attention as a Triton kernel for prefill, chunked prefill and decode over the block tables.

A program owns a tile of rows, (query tokens of one sequence) x (the query heads sharing one KV
head), so even a single decode token fills a tensor-core tile. In a decode step each sequence's
keys are split into a fixed number of segments whose partial results land in a workspace that is
reused across calls, and the last segment of a tile to finish merges them (kernels/key_segments.py):
the launch depends only on the step's shapes, never on its lengths, so a decode step captured in a CUDA
graph replays correctly with any sequence lengths.

A step that mixes decodes with longer queries (prefill chunks beside running sequences) launches
twice: its decodes tiled as a decode step (a tile of one token's group of heads, keys split into
segments) and the longer queries tiled for prefill. In one launch each decode would take a prefill
tile of up to 128 rows for its few heads and walk its whole context alone.

A step of decodes alone over a float cache may come with its keys and values unwritten and q unrotated
(`DecodeRotary`, `Ops.rotary_and_paged_attention`): each decode tile rotates its q rows as it loads them, and
the segment whose keys end at the token's own rotates that key and stores it and the value in the token's
slot before reading the cache, so the rotary kernel's launch, a layer's, is gone.

A quantized cache ("int8" or "fp8" codes, each row followed by its float32 scale: kv_codes.py) is read
by the same tiles: each block of keys and values is loaded as codes with its rows' scales and multiplied
out in float32 on the way to the dots, which take 16-bit operands where the queries are 16-bit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.availability import multiprocessor_count
from candelabra.backends.cuda.kernels import kv_codes
from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options
from candelabra.backends.cuda.kernels.key_segments import (
    decode_segments,
    decode_workspace,
    finish_rows,
    min_segment_steps,
    segment_keys,
)
from candelabra.backends.cuda.kernels.kv_codes import (
    FLOAT_CACHE,
    check_same_codes,
    row_alignment,
    row_features,
    row_strides,
)
from candelabra.backends.cuda.kernels.rotary import NO_ROTARY, STYLE_KINDS, head_rotation, rotate
from candelabra.backends.cuda.step import CudaStep

LOG2_E = math.log2(math.e)
# tl.dot needs at least 16 rows (and 16 columns) per operand.
MIN_DOT_SIZE = 16
TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class Tiling:
    queries: int  # query tokens per tile
    rows: int  # tile rows: queries x padded group, at least MIN_DOT_SIZE
    keys: int  # keys per inner step
    warps: int
    stages: int


def choose_tiling(max_query_len: int, group: int, head_dim_pad: int, float32_dot: bool) -> Tiling:
    """Tile shapes for sm_90: 16-bit operands go to the tensor cores (wgmma from 64 rows), and ptxas
    builds every such variant for sm_90a without spills (compile_check.SPILL_FREE holds it to that);
    so does every variant over a quantized cache, whose codes load 4 bytes to an instruction (kv_codes.row_alignment);
    float32 ones multiply exactly on the FMA units, whose operand layouts take far more registers,
    hence their narrow key steps and 8 warps, and a few of those variants spill a few words. On sm_80
    some 16-bit variants with groups of 7 or 8 query heads spill 4 to 8 bytes too."""
    group_pad = triton.next_power_of_2(group)
    decode = max_query_len == 1
    if float32_dot:
        keys = 32 if decode and head_dim_pad <= 128 else 16
        rows_wanted, stages = 32, 2
    else:
        keys = 64 if head_dim_pad <= 128 else 32
        rows_wanted, stages = (128 if head_dim_pad <= 128 else 64), 3
    queries = 1 if decode else min(max(1, rows_wanted // group_pad), triton.next_power_of_2(max_query_len))
    rows = max(MIN_DOT_SIZE, queries * group_pad)
    if float32_dot:
        warps = 8
    else:
        warps = 8 if rows >= 128 or (rows >= 64 and head_dim_pad > 128) else 4
    return Tiling(queries, rows, keys, warps, stages)


_decode_tilings: list[tuple[int, int] | None] = [None]


@contextlib.contextmanager
def decode_tiles(keys: int, stages: int) -> Iterator[None]:
    """Decode launches inside step through `keys` keys at a time with `stages` of them loaded ahead, whatever
    choose_tiling says: for bench/cuda_attention_split.py to measure other tilings of a decode tile."""
    if keys < MIN_DOT_SIZE or keys & (keys - 1) or stages < 1:
        raise ValueError(f"a decode tile steps through a power of two of keys, at least {MIN_DOT_SIZE}, with at "
                         f"least one stage; not {keys} keys in {stages} stages")
    _decode_tilings.append((keys, stages))
    try:
        yield
    finally:
        _decode_tilings.pop()


@dataclass(frozen=True)
class DecodeRotary:
    """What a decode step's attention needs to rotate q and write the step's keys and values itself
    (`Ops.rotary_and_write_kv` as `rotary.rotary_write_kv` runs it): the unrotated k [T, Hk, D] and v, the
    rotary positions [T] and cos_sin table [max_positions, R], its style, and the slots [T]."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    style: str
    slot_mapping: torch.Tensor

    def arguments(self) -> tuple:
        return (self.key, self.value, self.positions, self.cos_sin, self.slot_mapping)

    def strides(self) -> tuple[int, ...]:
        return (self.key.stride(0), self.key.stride(1), self.value.stride(0), self.value.stride(1),
                self.cos_sin.stride(0))


def fuses_rotary(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: CudaStep,
                 rotary: DecodeRotary) -> bool:
    """Whether `paged_attention` can rotate and write the step's rows itself: a step of decodes alone over a
    float cache, with rows and a table as `rotary.rotary_write_kv` takes them."""
    k, v = rotary.key, rotary.value
    rotary_dim = rotary.cos_sin.shape[-1]
    return (step.max_query_len == 1 and check_same_codes(key_cache, value_cache) == FLOAT_CACHE
            and rotary.style in STYLE_KINDS and rotary_dim % 2 == 0 and 0 < rotary_dim <= q.shape[2]
            and k.shape == v.shape == (q.shape[0], key_cache.shape[2], q.shape[2])
            and k.stride(-1) == v.stride(-1) == rotary.cos_sin.stride(-1) == 1
            and rotary.positions.shape == rotary.slot_mapping.shape == (q.shape[0],)
            and rotary.cos_sin.dtype == torch.float32)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: CudaStep,
                    scale: float, sliding_window: int | None = None,
                    logit_softcap: float | None = None, rotary: DecodeRotary | None = None) -> torch.Tensor:
    """`Ops.paged_attention`: q [T, Hq, D] over key_cache/value_cache [num_blocks, block_size, Hk, D]
    (or a quantized cache's [.., D + 4] bytes) through the step's block tables; returns [T, Hq, D] in q's
    dtype. With `rotary` (where `fuses_rotary`), q and the step's keys come unrotated and the keys and values
    unwritten: the decode tiles rotate and write them first (`Ops.rotary_and_write_kv`, then this)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if key_cache.shape[1] != step.block_size:
        raise ValueError(f"the cache has blocks of {key_cache.shape[1]} slots, the step {step.block_size}")
    codes = check_same_codes(key_cache, value_cache)
    if row_features(key_cache) != head_dim or row_features(value_cache) != head_dim:
        raise ValueError(f"caches of rows {key_cache.shape[-1]} and {value_cache.shape[-1]} wide do not hold "
                         f"heads of {head_dim}{' (+ 4 scale bytes)' if codes != FLOAT_CACHE else ''}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous along head_dim")

    group = num_heads // num_kv_heads
    head_dim_pad = max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))
    # Matching 16-bit operands go to the tensor cores as they are, and so do a quantized cache's values
    # beside 16-bit queries; anything else (float32, or a float cache dtype other than q's) is multiplied
    # in float32, exactly.
    sixteen_bit = q.dtype in (torch.float16, torch.bfloat16)
    dot_dtype = q.dtype if sixteen_bit and (
        codes != FLOAT_CACHE or key_cache.dtype == q.dtype == value_cache.dtype) else torch.float32
    launch = _AttentionLaunch(out, q, key_cache, value_cache, step, group, head_dim_pad, dot_dtype,
                              sliding_window, logit_softcap, scale, codes)
    if rotary is not None:
        if not fuses_rotary(q, key_cache, value_cache, step, rotary):
            raise ValueError("the attention rotates and writes the step's keys only in a step of decodes alone over a "
                             "float cache, with k and v [T, Hk, D] of unit stride along D and a float32 cos_sin table")
        launch.decodes(num_tokens, None, rotary)
    elif step.max_query_len == 1:
        launch.decodes(num_tokens, None)
    elif step.decode_tokens is not None:
        launch.decodes(int(step.decode_tokens.shape[0]), step.decode_tokens)
        launch.longer_queries(skip_decodes=True)
    else:
        launch.longer_queries(skip_decodes=False)
    return out


@dataclass
class _AttentionLaunch:
    """The arguments every launch of one paged_attention call shares."""

    out: torch.Tensor
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    step: CudaStep
    group: int
    head_dim_pad: int
    dot_dtype: torch.dtype
    sliding_window: int | None
    logit_softcap: float | None
    scale: float
    codes: str  # the cache's (kv_codes.py)

    def decodes(self, count: int, tokens: torch.Tensor | None, rotary: DecodeRotary | None = None) -> None:
        """One tile per decode token (all of the step's tokens, or those listed in `tokens`), its keys
        split into segments when the tiles alone leave SMs idle, merged by each tile's last segment."""
        q, num_kv_heads = self.q, self.key_cache.shape[2]
        tiling = choose_tiling(1, self.group, self.head_dim_pad, self.dot_dtype == torch.float32)
        if _decode_tilings[-1] is not None:
            keys, stages = _decode_tilings[-1]
            tiling = replace(tiling, keys=keys, stages=stages)
        segments = decode_segments(count, num_kv_heads, multiprocessor_count(q.device))
        num_tokens, num_heads, head_dim = q.shape
        if segments > 1:
            workspace = decode_workspace(q.device, q.dtype, num_tokens, num_heads, head_dim, segments)
            partials = (workspace.partial_out, workspace.partial_max, workspace.partial_sum, workspace.arrivals)
        else:
            partials = (self.out,) * 4  # never touched when there is a single segment
        self._tiles((count, num_kv_heads, segments), tiling, partials, tokens, skip_decodes=False, token_tiles=True,
                    rotary=rotary)

    def longer_queries(self, skip_decodes: bool) -> None:
        """Tiles of several query tokens of one sequence each, unsplit."""
        step = self.step
        tiling = choose_tiling(step.max_query_len, self.group, self.head_dim_pad, self.dot_dtype == torch.float32)
        # sequence b's tiles start at query_start_loc[b] // queries + b, so this many cover them all
        tiles = self.q.shape[0] // tiling.queries + step.num_seqs
        self._tiles((tiles, self.key_cache.shape[2], 1), tiling, (self.out,) * 4, None, skip_decodes,
                    token_tiles=False)

    def _tiles(self, grid, tiling: Tiling, partials, tokens, skip_decodes: bool, token_tiles: bool,
               rotary: DecodeRotary | None = None) -> None:
        q, out, key_cache, value_cache, step = self.q, self.out, self.key_cache, self.value_cache, self.step
        if self.logit_softcap is None:
            score_scale, capped_scale = self.scale * LOG2_E, 0.0
        else:
            score_scale, capped_scale = self.scale / self.logit_softcap, self.logit_softcap * LOG2_E
        num_seqs, num_heads, head_dim = step.num_seqs, q.shape[1], q.shape[2]
        alignment = row_alignment(key_cache, value_cache)
        _attention_tile_kernel[grid](
            out, *partials,
            q, key_cache, value_cache,
            step.block_tables, step.seq_lens, step.query_start_loc, step.token_positions, step.token_seq,
            tokens if tokens is not None else step.token_seq,
            *(rotary.arguments() if rotary is not None else (q, q, step.token_seq, q, step.token_seq)),
            num_seqs, (num_seqs - 1).bit_length(),  # binary-search steps over the sequences
            score_scale, capped_scale, self.sliding_window or 0, min_segment_steps(),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *row_strides(key_cache, alignment), *row_strides(value_cache, alignment),
            step.block_tables.stride(0),
            *(rotary.strides() if rotary is not None else (0,) * 5),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=self.head_dim_pad,
            GROUP=self.group, GROUP_PAD=triton.next_power_of_2(self.group),
            QUERIES_PER_TILE=tiling.queries, BLOCK_M=tiling.rows, BLOCK_N=tiling.keys,
            BLOCK_SIZE=step.block_size, NUM_SEGMENTS=grid[2],
            USE_SOFTCAP=self.logit_softcap is not None, USE_WINDOW=self.sliding_window is not None,
            DOT_DTYPE=TRITON_DTYPES[self.dot_dtype], TOKEN_LIST=tokens is not None, SKIP_DECODES=skip_decodes,
            TOKEN_TILES=token_tiles, CODES=self.codes, ROW_ALIGNMENT=alignment,
            ROTARY=NO_ROTARY.value if rotary is None else STYLE_KINDS[rotary.style],
            ROTARY_DIM=0 if rotary is None else rotary.cos_sin.shape[-1],
            num_warps=tiling.warps, num_stages=tiling.stages, **launch_options(q.device),
        )


@triton.jit
def _tanh(x):
    # from exp rather than a libdevice call, so the interpreter runs it; saturates to +-1
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def sequence_of_tile(query_start_loc_ptr, tile, num_seqs, search_steps, QUERIES_PER_TILE: tl.constexpr):
    """The last sequence b whose first tile, query_start_loc[b] // QUERIES_PER_TILE + b, is <= tile."""
    low = tl.full([], 0, tl.int32)
    high = tl.full([], 0, tl.int32) + num_seqs
    for _ in range(search_steps):
        middle = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // QUERIES_PER_TILE + middle
        starts_before = first_tile <= tile
        low = tl.where(starts_before, middle, low)
        high = tl.where(starts_before, high, middle)
    return low


# The batch's size and window are plain run-time values: specializing on them (Triton does for a 1 and
# for multiples of 16) would compile another kernel for batch 1 and for some windows, for nothing.
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "sliding_window", "min_segment_steps",
                               "stride_block_tables"])
def _attention_tile_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr,
    q_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, token_positions_ptr, token_seq_ptr, tile_tokens_ptr,
    new_keys_ptr, new_values_ptr, rope_positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    num_seqs, search_steps,
    score_scale, capped_scale, sliding_window, min_segment_steps,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_block_tables,
    stride_new_key_token, stride_new_key_head, stride_new_value_token, stride_new_value_head, stride_cos_sin,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    TOKEN_LIST: tl.constexpr, SKIP_DECODES: tl.constexpr, TOKEN_TILES: tl.constexpr, CODES: tl.constexpr,
    ROW_ALIGNMENT: tl.constexpr, ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, DEPENDENT: tl.constexpr,
):
    """A tile of query rows against its sequence's keys (or one segment of them). With TOKEN_TILES (the
    decodes' launch, one query a tile) tile t is one token: token t, or with TOKEN_LIST the t-th of
    tile_tokens. Otherwise tiles follow the sequences' queries in order, QUERIES_PER_TILE a tile (one
    too, where a group of query heads fills the tile), and with SKIP_DECODES those of one-token
    sequences (tiled by another launch) do nothing.
    With ROTARY a style (a decode step's tiles over a float cache), q and the token's own key and value come
    unrotated and unwritten (`new_keys_ptr`, `new_values_ptr`): each tile rotates its q rows as it loads them,
    and the segment holding the token's own key rotates it, writes it and the value to the token's slot, and
    only then reads the cache: `Ops.rotary_and_write_kv` in the attention's launch."""
    begin(DEPENDENT)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    if TOKEN_TILES:
        first_token = tile
        if TOKEN_LIST:
            first_token = tl.load(tile_tokens_ptr + tile)
        seq = tl.load(token_seq_ptr + first_token)
        tile_queries = 1
    else:
        seq = sequence_of_tile(query_start_loc_ptr, tile, num_seqs, search_steps, QUERIES_PER_TILE)
        seq_first_token = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - seq_first_token
        first_query = (tile - seq_first_token // QUERIES_PER_TILE - seq) * QUERIES_PER_TILE
        if first_query >= query_len:
            return
        if SKIP_DECODES:
            if query_len == 1:
                return
        first_token = seq_first_token + first_query
        tile_queries = tl.minimum(query_len - first_query, QUERIES_PER_TILE)

    rows = tl.arange(0, BLOCK_M)
    query_in_tile = rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (query_in_tile < tile_queries) & (head_in_group < GROUP)
    token = first_token + query_in_tile
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    position = tl.load(token_positions_ptr + token, mask=row_valid, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    key_end = tl.minimum(seq_len, tl.max(position, 0) + 1)
    key_begin = 0
    if USE_WINDOW:
        earliest = tl.min(tl.where(row_valid, position, seq_len), 0)
        key_begin = tl.maximum(earliest - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    used_segments = 1
    if NUM_SEGMENTS > 1:
        # the segment's share is computed here from the lengths on the device, so the grid never depends
        # on them; segments a sequence's keys leave nothing to write nothing, not even partial results
        key_begin, key_end, used_segments = segment_keys(key_begin, key_end, segment, NUM_SEGMENTS,
                                                          min_segment_steps, BLOCK_N)
        if segment >= used_segments:
            return

    q_rows = q_ptr + token * stride_q_token + head * stride_q_head
    if ROTARY != NO_ROTARY:
        partner, cos, sin = head_rotation(tl.load(rope_positions_ptr + first_token), cos_sin_ptr, stride_cos_sin, dims,
                                          ROTARY, ROTARY_DIM)
        q = rotate(q_rows, dims, partner, cos, sin, row_valid[:, None] & dim_valid[None, :], ROTARY_DIM)
        q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded as the rotary kernel stores it
        # the segment holding the token's own key writes it (the others' stores are masked off)
        _write_new_row(new_keys_ptr, new_values_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, first_token,
                       kv_head, dims, dim_valid & (segment == used_segments - 1), partner, cos, sin,
                       stride_new_key_token, stride_new_key_head, stride_new_value_token, stride_new_value_head,
                       stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                       BLOCK_SIZE, ROTARY_DIM)
        tl.debug_barrier()  # the loads below read the key and value just stored
    else:
        q = tl.load(q_rows[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :],
                    other=0.0).to(DOT_DTYPE)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_block_tables
    for start in range(key_begin, key_end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < key_end
        # masked, since past the sequence's last block the table row may end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        # Unused slots may hold NaN: loads outside the sequence read 0, and their scores are
        # masked below, since a NaN times a zero weight would still be NaN.
        # (A float cache's loads are kept exactly as they were before quantized caches: written like a
        # quantized one's, gemma-2's 256-wide soft-capped bfloat16 tiles spilled 4 bytes on sm_90a.)
        if CODES != "none":
            key_rows = key_cache_ptr + (block * stride_k_block + slot * stride_k_slot
                                        + kv_head * stride_k_head) * ROW_ALIGNMENT
            keys = tl.load(key_rows[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None], other=0)
            # the codes are exact in every dot dtype: each key's scale multiplies its float32 scores instead
            scores = tl.dot(q, kv_codes.decode(keys, CODES).to(DOT_DTYPE), input_precision="ieee")
            scores = scores * kv_codes.load_scales(key_rows + HEAD_DIM, key_valid, ROW_ALIGNMENT)[None, :]
        else:
            keys = tl.load(key_cache_ptr + block[None, :] * stride_k_block + slot[None, :] * stride_k_slot
                           + kv_head * stride_k_head + dims[:, None],
                           mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
            scores = tl.dot(q, keys.to(DOT_DTYPE), input_precision="ieee")
        if USE_SOFTCAP:
            scores = capped_scale * _tanh(scores * score_scale)
        else:
            scores = scores * score_scale
        visible = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > position[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # a row that has seen no visible key yet keeps weights of exactly 0, not NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp2(scores - shift[:, None])
        decay = tl.exp2(running_max - shift)
        running_sum = running_sum * decay + tl.sum(weights, 1)
        if CODES != "none":
            value_rows = value_cache_ptr + (block * stride_v_block + slot * stride_v_slot
                                            + kv_head * stride_v_head) * ROW_ALIGNMENT
            values = tl.load(value_rows[:, None] + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                             other=0)
            value_scales = kv_codes.load_scales(value_rows + HEAD_DIM, key_valid, ROW_ALIGNMENT)
            values = kv_codes.decode(values, CODES) * value_scales[:, None]
        else:
            values = tl.load(value_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                             + kv_head * stride_v_head + dims[None, :],
                             mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        acc = acc * decay[:, None] + tl.dot(weights.to(DOT_DTYPE), values.to(DOT_DTYPE), input_precision="ieee")
        running_max = new_max

    merge_token, merge_head, merge_valid = _merged_rows(token, head, row_valid, first_token, kv_head, GROUP,
                                                        GROUP_PAD, TOKEN_TILES)
    finish_rows(acc, running_max, running_sum, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr,
                token, head, dims, row_valid, dim_valid, stride_out_token, stride_out_head, NUM_HEADS, NUM_SEGMENTS,
                used_segments, segment, merge_token, merge_head, merge_valid, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _write_new_row(new_keys_ptr, new_values_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, token, kv_head,
                   dims, dim_valid, partner, cos, sin, stride_new_key_token, stride_new_key_head,
                   stride_new_value_token, stride_new_value_head, stride_k_block, stride_k_slot, stride_k_head,
                   stride_v_block, stride_v_slot, stride_v_head, BLOCK_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """Token `token`'s key, rotated, and value of KV head `kv_head` stored in a float cache at its slot (none
    at NO_SLOT, -1), as rotary.rotary_write_kv stores them."""
    key_row = new_keys_ptr + token * stride_new_key_token + kv_head * stride_new_key_head + tl.zeros([1], tl.int32)
    key = rotate(key_row, dims, partner, cos, sin, dim_valid[None, :], ROTARY_DIM)
    value = tl.load(new_values_ptr + token * stride_new_value_token + kv_head * stride_new_value_head + dims,
                    mask=dim_valid, other=0.0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block, offset = tl.maximum(slot, 0) // BLOCK_SIZE, tl.maximum(slot, 0) % BLOCK_SIZE
    stored = dim_valid & (slot >= 0)
    key_at = key_cache_ptr + block * stride_k_block + offset * stride_k_slot + kv_head * stride_k_head
    key = key.to(new_keys_ptr.dtype.element_ty).to(key_cache_ptr.dtype.element_ty)
    tl.store(key_at + dims[None, :], key, mask=stored[None, :])
    tl.store(value_cache_ptr + block * stride_v_block + offset * stride_v_slot + kv_head * stride_v_head + dims,
             value.to(value_cache_ptr.dtype.element_ty), mask=stored)


@triton.jit
def _merged_rows(token, head, row_valid, first_token, kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 TOKEN_TILES: tl.constexpr):
    """The rows a split tile's merge covers: a decode tile's first GROUP_PAD (its one token's heads; the
    rest are padding), or all of them."""
    if TOKEN_TILES:
        in_group = tl.arange(0, GROUP_PAD)
        return first_token + in_group * 0, kv_head * GROUP + in_group, in_group < GROUP
    else:
        return token, head, row_valid
