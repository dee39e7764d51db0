"""A split decode's key segments, shared by paged and latent attention: how many segments a decode step
takes, the workspace where each leaves its partial results, and how a tile's rows are finished. Whole, a
row is its weighted sum of values over its softmax sum; split, each segment stores its partial results
and the segment that arrives last at its tile merges them all and writes the rows: one launch a step's
attention, where a merge kernel after it cost a launch and its gap a layer. A sequence is split only as far as
its length warrants (segment_keys): short ones stay whole and write their rows directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A split decode aims at this many programs an SM, so that each keeps a few blocks of keys in flight, in at
# most MOST_SEGMENTS segments.
DECODE_PROGRAMS_PER_SM = 4
MOST_SEGMENTS = tl.constexpr(16)
# Each segment but a sequence's last walks at least this many steps of keys (a step loads about 32 KB of
# 16-bit keys and values): a split's stores of partial results, its atomic and the last segment's merge cost
# more than a few steps. The H200 trace of 27 November (night) had a 70-token context at batch 1, split in two
# segments of one step, take 13.5 µs a layer past the kernel before, where 16 segments and a merge kernel
# had taken 6.6 that morning. A guess, until bench/cuda_attention_split.py measures it: 4 keeps the contexts of
# 256 keys or fewer at heads of 128 whole, and splits a 4,096-token context 16 ways, as before.
MIN_SEGMENT_STEPS = 4
_segment_steps = [MIN_SEGMENT_STEPS]


def min_segment_steps() -> int:
    """The fewest steps of keys a segment of a split decode walks (MIN_SEGMENT_STEPS, or the innermost
    `segments_of_at_least`): a run-time argument of the kernels, so another value compiles nothing new."""
    return _segment_steps[-1]


@contextlib.contextmanager
def segments_of_at_least(steps: int) -> Iterator[None]:
    """Decode launches inside split a sequence's keys into segments of at least `steps` steps."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"a segment walks at least one step of keys, not {steps!r}")
    _segment_steps.append(steps)
    try:
        yield
    finally:
        _segment_steps.pop()


@dataclass(frozen=True)
class DecodeWorkspace:
    """Where the segments of a split-K decode leave their partial results, per (token, query
    head, segment): the unnormalised weighted sum of values, the running maximum of the scores
    (in log2 units) and the sum of exponentials below that maximum; and per tile of a token's heads,
    how many of its segments have finished (zero between launches)."""

    partial_out: torch.Tensor  # [T, Hq, segments, D] float32
    partial_max: torch.Tensor  # [T, Hq, segments] float32
    partial_sum: torch.Tensor  # [T, Hq, segments] float32
    arrivals: torch.Tensor  # [at least T * Hq] int32


_WORKSPACES: dict[tuple, DecodeWorkspace] = {}


def decode_workspace(device: torch.device, dtype: torch.dtype, num_tokens: int, num_heads: int,
                     head_dim: int, segments: int) -> DecodeWorkspace:
    """The workspace for these shapes: views of a buffer sized for the next power of two of
    `num_tokens`, allocated on first use and the same memory ever after (a captured graph keeps
    pointing at it), so batches of any size share a few buffers rather than one each."""
    capacity = triton.next_power_of_2(max(num_tokens, 1))
    key = (torch.device(device), dtype, capacity, num_heads, head_dim, segments)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        shape = (capacity, num_heads, segments)
        workspace = DecodeWorkspace(
            partial_out=torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            partial_max=torch.empty(shape, dtype=torch.float32, device=device),
            partial_sum=torch.empty(shape, dtype=torch.float32, device=device),
            arrivals=torch.zeros(capacity * num_heads, dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = workspace
    return DecodeWorkspace(workspace.partial_out[:num_tokens], workspace.partial_max[:num_tokens],
                           workspace.partial_sum[:num_tokens], workspace.arrivals)


def decode_segments(num_seqs: int, num_kv_heads: int, multiprocessors: int) -> int:
    """Key segments per (sequence, KV head) in a decode step: none when the batch's programs alone
    fill every SM (a split would only add partial sums and a merge), else enough for about
    DECODE_PROGRAMS_PER_SM programs an SM, 2 to MOST_SEGMENTS."""
    programs = num_seqs * num_kv_heads
    if programs >= multiprocessors:
        return 1
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * multiprocessors, programs)
    return min(MOST_SEGMENTS.value, max(2, triton.next_power_of_2(wanted)))


@triton.jit
def segment_keys(key_begin, key_end, segment, num_segments, min_steps, BLOCK_N: tl.constexpr):
    """Segment `segment`'s share [begin, end) of a sequence's keys [key_begin, key_end) in steps of BLOCK_N,
    and how many segments have a share: as many as a split into `num_segments` needs with each at least
    `min_steps` steps long (the last may be shorter), one where the keys are fewer."""
    steps = tl.cdiv(key_end - key_begin, BLOCK_N)
    # no longer than the keys, so that a segment's end stays inside int32 whatever `min_steps` is
    steps_per_segment = tl.maximum(tl.cdiv(steps, num_segments), tl.minimum(min_steps, steps))
    used_segments = tl.maximum(tl.cdiv(steps, steps_per_segment), 1)
    begin = key_begin + segment * steps_per_segment * BLOCK_N
    return begin, tl.minimum(key_end, begin + steps_per_segment * BLOCK_N), used_segments


@triton.jit
def finish_rows(acc, running_max, running_sum, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
                arrivals_ptr, token, head, columns, row_valid, column_valid, stride_out_token, stride_out_head,
                num_heads, num_segments, used_segments, segment, merge_token, merge_head, merge_valid,
                WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
    """Write a tile's rows (token, head) of `WIDTH` columns (`columns`, WIDTH_PAD of them) from its softmax
    state over its keys. With the keys split (the launch's `num_segments` segments, of which the first
    `used_segments` have keys), store this segment's partial state in the workspace; the segment that arrives
    last at the tile (program_id(0), program_id(1)) merges every used segment's, in segment order (the same
    sum whichever finishes first), writes the rows and resets the tile's count. The merge covers the rows
    (merge_token, merge_head) where merge_valid: every valid row of the tile, in as few rows as the caller
    can say (a decode tile's valid rows are its first), since the fewer they are, the wider the columns of
    each of its loads and the fewer its loads one after another."""
    if used_segments == 1:
        result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + columns[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & column_valid[None, :])
    else:
        # typed here: an unsplit launch (whose segment count may be a run-time value) passes any pointers
        partial_outs = partial_out_ptr.to(tl.pointer_type(tl.float32))
        partial_maxes = partial_max_ptr.to(tl.pointer_type(tl.float32))
        partial_sums = partial_sum_ptr.to(tl.pointer_type(tl.float32))
        arrivals = arrivals_ptr.to(tl.pointer_type(tl.int32))
        first = (token * num_heads + head) * num_segments
        tl.store(partial_outs + (first + segment)[:, None] * WIDTH + columns[None, :], acc,
                 mask=row_valid[:, None] & column_valid[None, :])
        tl.store(partial_maxes + first + segment, running_max, mask=row_valid)
        tl.store(partial_sums + first + segment, running_sum, mask=row_valid)
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(arrivals + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == used_segments - 1:
            _merge_segments(out_ptr, partial_outs, partial_maxes, partial_sums, merge_token, merge_head,
                            (merge_token * num_heads + merge_head) * num_segments, merge_valid,
                            stride_out_token, stride_out_head, used_segments, WIDTH, WIDTH_PAD)
            tl.atomic_xchg(arrivals + tile, 0, sem="relaxed", scope="gpu")


# The merge holds [rows, MOST_SEGMENTS, columns] float32 partial sums at a time, this many in all: a tile's
# worth (the latent tiles' [64, 512] accumulator took every register) would spill.
MERGE_ELEMENTS = tl.constexpr(4096)


@triton.jit
def _merge_segments(out_ptr, partial_outs, partial_maxes, partial_sums, token, head, first, row_valid,
                    stride_out_token, stride_out_head, used_segments, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
    segments = tl.arange(0, MOST_SEGMENTS)
    held = row_valid[:, None] & (segments < used_segments)[None, :]
    maxes = tl.load(partial_maxes + first[:, None] + segments[None, :], mask=held, other=float("-inf"),
                    cache_modifier=".cg")
    overall = tl.max(maxes, 1)
    # an empty segment has max -inf and sum 0: its weight is exactly 0
    weights = tl.exp2(maxes - tl.where(overall == float("-inf"), 0.0, overall)[:, None])
    total = tl.sum(tl.load(partial_sums + first[:, None] + segments[None, :], mask=held, other=0.0,
                           cache_modifier=".cg") * weights, 1)
    total = tl.where(total > 0, total, 1.0)
    ROWS: tl.constexpr = row_valid.shape[0]
    CHUNK: tl.constexpr = max(1, min(WIDTH_PAD, MERGE_ELEMENTS // (ROWS * MOST_SEGMENTS)))
    for start in range(0, WIDTH_PAD, CHUNK):
        columns = start + tl.arange(0, CHUNK)
        in_width = (columns < WIDTH)[None, None, :]
        outs = tl.load(partial_outs + (first[:, None, None] + segments[None, :, None]) * WIDTH + columns[None, None, :],
                       mask=held[:, :, None] & in_width, other=0.0, cache_modifier=".cg")
        merged = tl.sum(outs * weights[:, :, None], 1) / total[:, None]
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + columns[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (columns < WIDTH)[None, :])
