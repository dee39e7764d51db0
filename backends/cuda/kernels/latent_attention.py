"""Multi-head latent attention (DeepSeek V2/V3, absorbed form) as a Triton kernel over the latent cache.

The cache has one KV head: each key's latent c (R values, 512 in the real models) is both the larger
part of its key and its whole value, and its rotary key r (P, 64) the rest of the key. A program owns a
tile of rows, (query tokens of one sequence) x (query heads), every row meeting the same keys, so each
tile of latents is loaded once for all of them and serves both dots: scores q_latent . c + q_rope . r,
then the softmax weights times c. A [rows, R] float32 accumulator bounds the rows a program holds (64
with 16-bit operands): a token's heads are split over several programs where there are more of them than
that, two for DeepSeek-V3's 128.

The launches follow kernels/paged_attention.py: a decode step splits each sequence's keys into segments
when its tiles alone leave SMs idle, into a workspace reused across calls, and each tile's last segment
to finish merges them (kernels/key_segments.py); a step mixing decodes with longer queries launches
twice, its decodes tiled as a decode step. No launch depends on the sequences' lengths, so a decode step
can be captured in a CUDA graph.

A quantized latent cache ("int8" or "fp8" codes, each row followed by its float32 scale: kv_codes.py) is
read by the same tiles: a tile of latents and of rotary keys is loaded as codes with its rows' scales, the
codes go into the dots as they are, and the scales multiply in float32 what the dots give per key (the
scores) and take (the softmax weights), which takes fewer registers than multiplying the [keys, 512] tile
out first.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from candelabra.backends.cuda.kernels.paged_attention import LOG2_E, MIN_DOT_SIZE, TRITON_DTYPES, sequence_of_tile
from candelabra.backends.cuda.step import CudaStep

# Most rows a program holds: its accumulator is [rows, R] float32 (see choose_latent_tiling).
MAX_ROWS = 64
MAX_FLOAT32_ROWS = 16


@dataclass(frozen=True)
class LatentTiling:
    heads: int  # query heads per tile, a power of two
    queries: int  # query tokens per tile
    rows: int  # tile rows: queries x heads, at least MIN_DOT_SIZE
    keys: int  # keys per inner step
    warps: int
    stages: int


def choose_latent_tiling(max_query_len: int, num_heads: int, float32_dot: bool) -> LatentTiling:
    """Tile shapes for sm_90 at R = 512: a token's heads, up to MAX_ROWS of them, or a few tokens' where
    there are fewer heads. 16-bit operands go to the tensor cores (wgmma from 64 rows), and 8 warps hold a
    64-row tile's [64, 512] float32 accumulator in 247 to 253 registers a thread (16 rows: 158); ptxas
    builds every such variant for sm_90a without spills (compile_check.SPILL_FREE holds it to that), where
    4 warps spill kilobytes. On sm_80 one 64-row tile spills 4 bytes. float32 operands multiply on the FMA
    units, whose operand layouts take far more registers: 16 rows and 16 keys a step. Over a quantized
    cache ("int8", "fp8") the 16-row tile builds without spills on sm_90a, but the 64-row one spills 360
    to 390 bytes (16 or 32 keys a step, 1 to 3 stages alike, and 32 rows worse): its codes are converted
    in registers on their way to the tensor cores."""
    most_rows = MAX_FLOAT32_ROWS if float32_dot else MAX_ROWS
    heads = min(triton.next_power_of_2(num_heads), most_rows)
    queries = 1 if max_query_len == 1 else min(most_rows // heads, triton.next_power_of_2(max_query_len))
    return LatentTiling(heads, queries, rows=max(MIN_DOT_SIZE, queries * heads), keys=16 if float32_dot else 32,
                        warps=8, stages=2)


def paged_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, rope_cache: torch.Tensor,
                           latent_cache: torch.Tensor, step: CudaStep, scale: float) -> torch.Tensor:
    """`Ops.paged_latent_attention`: q_latent [T, H, R] and q_rope [T, H, P] over the latent cache
    (rope_cache [num_blocks, block_size, 1, P], latent_cache [num_blocks, block_size, 1, R], or a quantized
    cache's [.., P + 4] and [.., R + 4] bytes) through the step's block tables; returns [T, H, R] in
    q_latent's dtype."""
    codes = _check_shapes(q_latent, q_rope, rope_cache, latent_cache, step)
    num_tokens, num_heads, rank = q_latent.shape
    out = torch.empty((num_tokens, num_heads, rank), dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0:
        return out
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    sixteen_bit = q_latent.dtype in (torch.float16, torch.bfloat16)
    same = q_latent.dtype == q_rope.dtype and (
        codes != FLOAT_CACHE or q_latent.dtype == rope_cache.dtype == latent_cache.dtype)
    launch = _LatentLaunch(out, q_latent, q_rope, rope_cache, latent_cache, step, scale,
                           dot_dtype=q_latent.dtype if sixteen_bit and same else torch.float32, codes=codes)
    if step.max_query_len == 1:
        launch.decodes(num_tokens, None)
    elif step.decode_tokens is not None:
        launch.decodes(int(step.decode_tokens.shape[0]), step.decode_tokens)
        launch.longer_queries(skip_decodes=True)
    else:
        launch.longer_queries(skip_decodes=False)
    return out


def _check_shapes(q_latent, q_rope, rope_cache, latent_cache, step: CudaStep) -> str:
    """The cache's codes (kv_codes.py), once the shapes agree."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent [T, H, R] and q_rope [T, H, P] must agree on T and H; got "
                         f"{list(q_latent.shape)} and {list(q_rope.shape)}")
    num_tokens, _, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    codes = check_same_codes(rope_cache, latent_cache)
    blocks = rope_cache.shape[:2]
    if (tuple(rope_cache.shape[:3]) != (*blocks, 1) or tuple(latent_cache.shape[:3]) != (*blocks, 1)
            or row_features(rope_cache) != rope_dim or row_features(latent_cache) != rank):
        scale = " + 4 scale bytes" if codes != FLOAT_CACHE else ""
        raise ValueError(f"a latent cache has one KV head: key [blocks, block_size, 1, {rope_dim}{scale}] and value "
                         f"[blocks, block_size, 1, {rank}{scale}]; got {list(rope_cache.shape)} and "
                         f"{list(latent_cache.shape)}")
    if blocks[1] != step.block_size:
        raise ValueError(f"the cache has blocks of {blocks[1]} slots, the step {step.block_size}")
    if num_tokens != step.num_tokens:
        raise ValueError(f"{num_tokens} query tokens for a step of {step.num_tokens}")
    if rope_cache.stride(-1) != 1 or latent_cache.stride(-1) != 1:
        raise ValueError("the latent cache must be contiguous along its last axis")
    return codes


@dataclass
class _LatentLaunch:
    """The arguments every launch of one paged_latent_attention call shares."""

    out: torch.Tensor
    q_latent: torch.Tensor
    q_rope: torch.Tensor
    rope_cache: torch.Tensor
    latent_cache: torch.Tensor
    step: CudaStep
    scale: float
    dot_dtype: torch.dtype
    codes: str  # the cache's (kv_codes.py)

    def tiling(self, max_query_len: int) -> LatentTiling:
        return choose_latent_tiling(max_query_len, self.q_latent.shape[1], self.dot_dtype == torch.float32)

    def decodes(self, count: int, tokens: torch.Tensor | None) -> None:
        """One tile per decode token and group of heads (all of the step's tokens, or those listed in
        `tokens`), its keys split into segments when the tiles alone leave SMs idle, merged by each tile's
        last segment."""
        num_tokens, num_heads, rank = self.q_latent.shape
        tiling = self.tiling(1)
        head_tiles = triton.cdiv(num_heads, tiling.heads)
        segments = decode_segments(count, head_tiles, multiprocessor_count(self.out.device))
        if segments > 1:
            workspace = decode_workspace(self.out.device, self.out.dtype, num_tokens, num_heads, rank, segments)
            partials = (workspace.partial_out, workspace.partial_max, workspace.partial_sum, workspace.arrivals)
        else:
            partials = (self.out,) * 4  # never touched when there is a single segment
        self._tiles((count, head_tiles, segments), tiling, partials, tokens, skip_decodes=False)

    def longer_queries(self, skip_decodes: bool) -> None:
        """Tiles of several query tokens of one sequence each, unsplit."""
        step = self.step
        tiling = self.tiling(step.max_query_len)
        if tiling.queries == 1:
            tiles = self.q_latent.shape[0]  # a tile per token
        else:
            # sequence b's tiles start at query_start_loc[b] // queries + b, so this many cover them all
            tiles = self.q_latent.shape[0] // tiling.queries + step.num_seqs
        head_tiles = triton.cdiv(self.q_latent.shape[1], tiling.heads)
        self._tiles((tiles, head_tiles, 1), tiling, (self.out,) * 4, None, skip_decodes)

    def _tiles(self, grid, tiling: LatentTiling, partials, tokens, skip_decodes: bool) -> None:
        q_latent, q_rope, out, step = self.q_latent, self.q_rope, self.out, self.step
        rope_cache, latent_cache = self.rope_cache, self.latent_cache
        num_seqs, num_heads, rank = step.num_seqs, q_latent.shape[1], q_latent.shape[2]
        rope_dim = q_rope.shape[2]
        alignment = row_alignment(rope_cache, latent_cache)
        _latent_attention_kernel[grid](
            out, *partials,
            q_latent, q_rope, rope_cache, latent_cache,
            step.block_tables, step.seq_lens, step.query_start_loc, step.token_positions, step.token_seq,
            tokens if tokens is not None else step.token_seq,
            num_seqs, (num_seqs - 1).bit_length(),  # binary-search steps over the sequences
            num_heads, grid[2], min_segment_steps(), int(tokens is not None), int(skip_decodes), self.scale * LOG2_E,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            out.stride(0), out.stride(1),
            *row_strides(rope_cache, alignment)[:2], *row_strides(latent_cache, alignment)[:2],
            step.block_tables.stride(0),
            RANK=rank, RANK_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(rank)),
            ROPE_DIM=rope_dim, ROPE_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(rope_dim)),
            HEADS_PER_TILE=tiling.heads, QUERIES_PER_TILE=tiling.queries, BLOCK_M=tiling.rows,
            BLOCK_N=tiling.keys, BLOCK_SIZE=step.block_size, DOT_DTYPE=TRITON_DTYPES[self.dot_dtype],
            CODES=self.codes, ROW_ALIGNMENT=alignment, num_warps=tiling.warps, num_stages=tiling.stages,
            **launch_options(out.device),
        )


# Only the tile's shape and the dtypes are compiled in: the head count, the segments, and which launch of
# a step this is are plain run-time values, and so are the batch's size and the heads (Triton would
# specialize on a 1 and on multiples of 16), so that serving a model compiles a few variants, not dozens.
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "num_heads", "num_segments", "min_segment_steps",
                               "token_list", "skip_decodes", "stride_block_tables"])
def _latent_attention_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr,
    q_latent_ptr, q_rope_ptr, rope_cache_ptr, latent_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, token_positions_ptr, token_seq_ptr, tile_tokens_ptr,
    num_seqs, search_steps, num_heads, num_segments, min_segment_steps, token_list, skip_decodes, score_scale,
    stride_ql_token, stride_ql_head, stride_qr_token, stride_qr_head, stride_out_token, stride_out_head,
    stride_rope_block, stride_rope_slot, stride_latent_block, stride_latent_slot,
    stride_block_tables,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr, QUERIES_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, CODES: tl.constexpr, ROW_ALIGNMENT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A tile of query rows, (tokens) x (heads of head tile program_id(1)), against its sequence's keys
    (or one of num_segments segments of them). With QUERIES_PER_TILE 1 tile t is one token: token t, or
    with token_list the t-th of tile_tokens. Otherwise tiles follow the sequences' queries in order. With
    skip_decodes the tiles of one-token sequences (tiled by another launch) do nothing."""
    begin(DEPENDENT)
    tile = tl.program_id(0)
    head_tile = tl.program_id(1)
    segment = tl.program_id(2)

    if QUERIES_PER_TILE == 1:
        first_token = tile
        if token_list:
            first_token = tl.load(tile_tokens_ptr + tile)
        seq = tl.load(token_seq_ptr + first_token)
        tile_queries = 1
        if skip_decodes:
            if tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq) == 1:
                return
    else:
        seq = sequence_of_tile(query_start_loc_ptr, tile, num_seqs, search_steps, QUERIES_PER_TILE)
        seq_first_token = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - seq_first_token
        first_query = (tile - seq_first_token // QUERIES_PER_TILE - seq) * QUERIES_PER_TILE
        if first_query >= query_len:
            return
        if skip_decodes:
            if query_len == 1:
                return
        first_token = seq_first_token + first_query
        tile_queries = tl.minimum(query_len - first_query, QUERIES_PER_TILE)

    rows = tl.arange(0, BLOCK_M)
    query_in_tile = rows // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
    row_valid = (query_in_tile < tile_queries) & (head < num_heads)
    token = first_token + query_in_tile
    ranks = tl.arange(0, RANK_PAD)
    rank_valid = ranks < RANK
    ropes = tl.arange(0, ROPE_PAD)
    rope_valid = ropes < ROPE_DIM

    position = tl.load(token_positions_ptr + token, mask=row_valid, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    key_end = tl.minimum(seq_len, tl.max(position, 0) + 1)
    key_begin = 0
    used_segments = 1
    if num_segments > 1:
        # the segment's share is computed here from the lengths on the device, so the grid never depends
        # on them; segments a sequence's keys leave nothing to write nothing, not even partial results
        key_begin, key_end, used_segments = segment_keys(0, key_end, segment, num_segments, min_segment_steps,
                                                          BLOCK_N)
        if segment >= used_segments:
            return

    q_latent = tl.load(q_latent_ptr + token[:, None] * stride_ql_token + head[:, None] * stride_ql_head
                       + ranks[None, :], mask=row_valid[:, None] & rank_valid[None, :], other=0.0).to(DOT_DTYPE)
    q_rope = tl.load(q_rope_ptr + token[:, None] * stride_qr_token + head[:, None] * stride_qr_head
                     + ropes[None, :], mask=row_valid[:, None] & rope_valid[None, :], other=0.0).to(DOT_DTYPE)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_block_tables
    for start in range(key_begin, key_end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < key_end
        # masked, since past the sequence's last block the table row may end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        # Unused slots may hold NaN: loads outside the keys read 0, and their scores are masked below,
        # since a NaN latent times a zero weight would still be NaN.
        latent_rows = latent_cache_ptr + (block * stride_latent_block + slot * stride_latent_slot) * ROW_ALIGNMENT
        latents = tl.load(latent_rows[:, None] + ranks[None, :], mask=key_valid[:, None] & rank_valid[None, :],
                          other=0)
        rope_rows = rope_cache_ptr + (block * stride_rope_block + slot * stride_rope_slot) * ROW_ALIGNMENT
        rope_keys = tl.load(rope_rows[None, :] + ropes[:, None], mask=key_valid[None, :] & rope_valid[:, None],
                            other=0)
        if CODES != "none":
            # the codes enter the dots as they are (exact in every dot dtype), each key's scales multiplying
            # its float32 scores, and the latent's scale its weight before the dot with the latents
            latent_scales = kv_codes.load_scales(latent_rows + RANK, key_valid, ROW_ALIGNMENT)
            rope_scales = kv_codes.load_scales(rope_rows + ROPE_DIM, key_valid, ROW_ALIGNMENT)
            latents = kv_codes.decode(latents, CODES).to(DOT_DTYPE)
            scores = tl.dot(q_latent, tl.trans(latents), input_precision="ieee") * latent_scales[None, :]
            rope_scores = tl.dot(q_rope, kv_codes.decode(rope_keys, CODES).to(DOT_DTYPE), input_precision="ieee")
            scores = (scores + rope_scores * rope_scales[None, :]) * score_scale
        else:
            latents = latents.to(DOT_DTYPE)
            scores = tl.dot(q_latent, tl.trans(latents), input_precision="ieee")
            scores = tl.dot(q_rope, rope_keys.to(DOT_DTYPE), scores, input_precision="ieee") * score_scale
        visible = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # a row that has seen no visible key yet keeps weights of exactly 0, not NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp2(scores - shift[:, None])
        decay = tl.exp2(running_max - shift)
        running_sum = running_sum * decay + tl.sum(weights, 1)
        if CODES != "none":
            weights = weights * latent_scales[None, :]
        acc = acc * decay[:, None] + tl.dot(weights.to(DOT_DTYPE), latents, input_precision="ieee")
        running_max = new_max

    finish_rows(acc, running_max, running_sum, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr,
                token, head, ranks, row_valid, rank_valid, stride_out_token, stride_out_head, num_heads, num_segments,
                used_segments, segment, token, head, row_valid, RANK, RANK_PAD)
