"""Token sampling in two Triton launches (semantics: `Ops.sample`).

Logit bias and penalties are sparse scatters left to torch. The first launch splits each row into
chunks, a program each, that find the chunk's maximum, its first id, and its sum of exponentials;
then one program a row combines them into the row's maximum, log-sum-exp and greedy choice, and
rows that draw at random find their top-k and top-p thresholds and draw by inverse CDF in increasing
id order.

In a batch of up to CANDIDATE_ROWS rows, a row with a top-k or top-p filter first looks among its
CANDIDATES most probable tokens (torch.topk, before the kernel): when the filter's threshold lies
strictly above the least of them, every token it keeps is among them, and the threshold and the draw
take a few passes over them alone. Otherwise the row searches its whole vocabulary: a many-way search
over probability values instead of a sort, each pass a stream over the row. A larger batch searches
before the draw, each pass split over (row, chunk) programs with the rows' brackets in memory between
launches. On an H200 at a 152k vocabulary, top-p 0.9 took 0.81 ms a row searching the whole row, 0.31
among candidates, and 0.96 ms for 64 rows searching one program a row (the split passes are not yet
measured); greedy 0.09, when one program a row also walked the row for its statistics (not yet
measured split). Nothing here waits for the device.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options
from candelabra.backends.torch.sampling import TorchSampling, _penalised_logits, _top_logprobs
from candelabra.core.contract.ops import SampleResult

# Elements per step of the passes that touch each element once (row statistics, the draw).
ROW_BLOCK = 2048
# The row statistics (maximum, greedy choice, log-sum-exp) are one pass split over programs of this
# many row blocks each, their results combined by _sample_rows: one program walking a 152k row alone
# waited on 75 loads one after another (0.09 ms a step on an H200, greedy).
STATISTICS_BLOCKS = 2
STATISTICS_WARPS = 4
# Most probable tokens a filtered row looks among first (a power of two); a vocabulary no larger
# than this goes straight to the whole-row search.
CANDIDATES = 1024
# torch.topk's cost grows with the rows while the whole-row search runs a row an SM: at a 152k
# vocabulary on an H200, top-p 0.9 took 0.31 ms with candidates against 0.81 without at 1 row, but
# 1.53 against 0.96 at 64. Batches up to this many rows look among candidates.
CANDIDATE_ROWS = 16
# Elements per step of a threshold search pass, which compares each element with every pivot.
SEARCH_BLOCK = 512
# Trial thresholds per search pass: each pass narrows the bracket 16-fold, so a float32 value
# in (0, 1] (30 bits of pattern) is pinned down exactly in at most 8 passes, usually fewer.
PIVOTS = 16
# A safety bound only; the bracket reaches a single bit pattern well before it.
MAX_SEARCH_PASSES = 12
# Batches too large for candidates search their rows in passes split over programs of this many
# logits, a launch a pass: one program a row searching alone took 0.96 ms at 64 rows of 152k on an
# H200 for top-p 0.9, 64 of its 132 SMs busy. The patterns of (0, 1] span under 2**30 and a pass
# keeps at most 1/PIVOTS of the bracket, so SPLIT_SEARCH_PASSES launches always close it.
SEARCH_CHUNK = 4096
SPLIT_SEARCH_PASSES = math.ceil(30 / math.log2(PIVOTS))
# A search pass holds [SEARCH_BLOCK, PIVOTS] float32 lane sums: 32 a thread at 8 warps. Compiled
# for sm_90 the kernel uses about 125 registers and no spills, so two programs fit an SM.
NUM_WARPS = 8

_LOG2E = tl.constexpr(1.4426950408889634)
_ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0: no weight lies above it
_NO_ID = tl.constexpr(0x7FFFFFFF)
_BELOW_ANY_LOGIT = tl.constexpr(-1e30)  # below any logit but -inf, and far from overflowing when scaled


@triton.jit
def _temperature_scale(temperature_ptr, row, ANY_RANDOM: tl.constexpr):
    """The row's temperature (0 where no row draws at random) and what multiplies x - max into the
    exponent of 2 of its weights: log2(e) / temperature, or log2(e) for a greedy row."""
    temperature = 0.0
    if ANY_RANDOM:
        temperature = tl.load(temperature_ptr + row)
    return temperature, tl.where(temperature > 0, _LOG2E / tl.maximum(temperature, 1e-30), _LOG2E)


@triton.jit
def _chunk_statistics(row_ptr, start, VOCAB: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, scale,
                      SCALED_SUM: tl.constexpr):
    """Over ids start .. start + CHUNK - 1 of the row: the maximum, the lowest id holding it, the
    minimum, sum(exp(x - max)), and with SCALED_SUM sum(exp((x - max) * scale / log2(e))) (the weights'
    total at the row's temperature, in float64).

    Each lane keeps its own running maximum, first id and rescaled sums across the blocks, so
    that the chunk is reduced across lanes once, at the end.
    """
    offsets = tl.arange(0, BLOCK)
    # A finite floor keeps every difference below finite, also in lanes that only see -inf.
    lane_max = tl.full([BLOCK], _BELOW_ANY_LOGIT, tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    lane_id = tl.zeros([BLOCK], tl.int32)
    lane_sum = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - lane_max)
    lane_scaled_sum = tl.zeros([BLOCK], tl.float32)  # sum of exp2((x - lane_max) * scale)
    for step in tl.static_range(0, CHUNK, BLOCK):
        ids = start + step + offsets
        x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp2((lane_max - new_max) * _LOG2E) + tl.exp2((x - new_max) * _LOG2E)
        if SCALED_SUM:
            lane_scaled_sum = (lane_scaled_sum * tl.exp2((lane_max - new_max) * scale)
                               + tl.exp2((x - new_max) * scale))
        lane_id = tl.where(x > lane_max, ids, lane_id)  # strictly greater: a lane keeps its first maximum
        lane_max = new_max
        lane_min = tl.minimum(lane_min, tl.where(ids < VOCAB, x, float("inf")))
    chunk_max = tl.max(lane_max, axis=0)
    chunk_max_id = tl.min(tl.where(lane_max == chunk_max, lane_id, _NO_ID), axis=0)
    chunk_sum = tl.sum(lane_sum * tl.exp2((lane_max - chunk_max) * _LOG2E), axis=0)
    scaled_sum = 0.0
    if SCALED_SUM:
        scaled_sum = tl.sum((lane_scaled_sum * tl.exp2((lane_max - chunk_max) * scale)).to(tl.float64), axis=0)
    return chunk_max, chunk_max_id, tl.min(lane_min, axis=0), chunk_sum, scaled_sum


@triton.jit
def _chunk_statistics_kernel(
    logits_ptr, row_stride, temperature_ptr,
    chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_scaled_sum_ptr,
    VOCAB: tl.constexpr, ROW_BLOCK: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
    ANY_RANDOM: tl.constexpr, SCALED_SUM: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A (row, chunk) program: its chunk's statistics, for _sample_rows to combine."""
    begin(DEPENDENT)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    _, scale = _temperature_scale(temperature_ptr, row, ANY_RANDOM)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    chunk_max, chunk_max_id, chunk_min, chunk_sum, scaled_sum = _chunk_statistics(
        row_ptr, chunk * CHUNK, VOCAB, ROW_BLOCK, CHUNK, scale, SCALED_SUM)
    at = row * CHUNKS + chunk
    tl.store(chunk_max_ptr + at, chunk_max)
    tl.store(chunk_max_id_ptr + at, chunk_max_id)
    tl.store(chunk_min_ptr + at, chunk_min)
    tl.store(chunk_sum_ptr + at, chunk_sum)
    if SCALED_SUM:
        tl.store(chunk_scaled_sum_ptr + at, scaled_sum)


@triton.jit
def _row_statistics(row, chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_scaled_sum_ptr,
                    scale, CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, SCALED_SUM: tl.constexpr):
    """The row's maximum, the lowest id holding it, its minimum, log(sum(exp(x))), and with
    SCALED_SUM the weights' total at the row's temperature: its chunks' statistics combined."""
    chunks = tl.arange(0, CHUNKS_POW2)
    held = chunks < CHUNKS
    at = row * CHUNKS + chunks
    chunk_max = tl.load(chunk_max_ptr + at, mask=held, other=_BELOW_ANY_LOGIT)
    row_max = tl.max(chunk_max, axis=0)
    row_max_id = tl.min(tl.where(held & (chunk_max == row_max),
                                 tl.load(chunk_max_id_ptr + at, mask=held, other=_NO_ID), _NO_ID), axis=0)
    # NaN equals no maximum: such a row keeps id 0 rather than read past its end.
    row_max_id = tl.where(row_max_id == _NO_ID, 0, row_max_id)
    row_min = tl.min(tl.load(chunk_min_ptr + at, mask=held, other=float("inf")), axis=0)
    shares = tl.load(chunk_sum_ptr + at, mask=held, other=0.0) * tl.exp2((chunk_max - row_max) * _LOG2E)
    scaled_total = 0.0
    if SCALED_SUM:
        scaled_total = tl.sum(tl.load(chunk_scaled_sum_ptr + at, mask=held, other=0.0)
                              * tl.exp2((chunk_max - row_max) * scale).to(tl.float64), axis=0)
    return row_max, row_max_id, row_min, row_max + tl.log(tl.sum(shares, axis=0)), scaled_total


@triton.jit
def _weights(row_ptr, ids, VOCAB: tl.constexpr, row_max, scale):
    """exp((x - max) / temperature) at `ids`, -1 past the vocabulary (below every weight)."""
    x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=0.0).to(tl.float32)
    return tl.where(ids < VOCAB, tl.exp2((x - row_max) * scale), -1.0)


@triton.jit
def _pivot_bits(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS bit patterns spread evenly over the bracket [lo, hi), lo first."""
    return lo + (((hi - lo).to(tl.int64) * tl.arange(0, PIVOTS)) // PIVOTS).to(tl.int32)


@triton.jit
def _reach(row_ptr, begin, end, VOCAB: tl.constexpr, row_max, scale, lo, hi, pivot_bits,
           GOAL_IS_FRACTION: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """Over ids begin .. end - 1 (end - begin a multiple of BLOCK): F at each pivot (float64), and the
    smallest and largest weight inside the bracket [lo, hi) (inf and -1 when none is)."""
    offsets = tl.arange(0, BLOCK)
    pivots = pivot_bits.to(tl.float32, bitcast=True)
    lo_value = lo.to(tl.float32, bitcast=True)
    hi_value = hi.to(tl.float32, bitcast=True)
    lane_reach = tl.zeros([BLOCK, PIVOTS], tl.float32)
    lane_smallest = tl.full([BLOCK], float("inf"), tl.float32)
    lane_largest = tl.full([BLOCK], -1.0, tl.float32)
    for start in range(begin, end, BLOCK):
        w = _weights(row_ptr, start + offsets, VOCAB, row_max, scale)
        at_or_above = w[:, None] >= pivots[None, :]
        if GOAL_IS_FRACTION:
            lane_reach += tl.where(at_or_above, w[:, None], 0.0)
        else:
            lane_reach += at_or_above.to(tl.float32)
        inside = (w >= lo_value) & (w < hi_value)
        lane_smallest = tl.minimum(lane_smallest, tl.where(inside, w, float("inf")))
        lane_largest = tl.maximum(lane_largest, tl.where(inside, w, -1.0))
    return tl.sum(lane_reach.to(tl.float64), axis=0), tl.min(lane_smallest, axis=0), tl.max(lane_largest, axis=0)


@triton.jit
def _narrowed(lo, hi, pivot_bits, reach, target, smallest, largest):
    """The bracket after a pass: between the last pivot that reaches the target and the first that
    does not, closed in on the weights it holds. No weight lies in [lo, smallest) or (largest, hi),
    so F is flat there, and a bracket holding a single value closes at once."""
    reached = reach >= target
    new_hi = tl.minimum(hi, tl.min(tl.where(reached, hi, pivot_bits), axis=0))
    new_lo = tl.max(tl.where(reached & (pivot_bits < new_hi), pivot_bits, lo), axis=0)
    new_lo = tl.maximum(new_lo, smallest.to(tl.int32, bitcast=True))
    new_hi = tl.minimum(new_hi, largest.to(tl.int32, bitcast=True) + 1)
    return new_lo, tl.maximum(new_hi, new_lo + 1)


@triton.jit
def _at_first_pivot(reach, PIVOTS: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, PIVOTS) == 0, reach, 0.0), axis=0)


@triton.jit
def _threshold(row_ptr, VOCAB: tl.constexpr, row_max, scale, floor, goal, GOAL_IS_FRACTION: tl.constexpr,
               BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The largest t >= floor with F(t) >= target, F(t) the number (count mode) or the summed
    weight (fraction mode) of the weights w >= t; target is `goal`, or in fraction mode `goal`
    times F(floor). That t is always one of the weights, so the candidates are exactly w >= t.

    The search keeps a bracket [lo, hi) of float32 bit patterns (monotonic for w >= 0) with
    F(lo) >= target > F(hi). Each pass evaluates F at PIVOTS points spread over the bracket, lo
    included, and also notes the smallest and largest weight inside it (_narrowed).
    """
    lo = floor.to(tl.int32, bitcast=True)
    hi = tl.full([], _ONE_BITS + 1, tl.int32)
    target = goal
    passes = tl.full([], 0, tl.int32)
    while (hi - lo > 1) & (passes < MAX_PASSES):
        pivot_bits = _pivot_bits(lo, hi, PIVOTS)
        reach, smallest, largest = _reach(row_ptr, 0, VOCAB, VOCAB, row_max, scale, lo, hi, pivot_bits,
                                          GOAL_IS_FRACTION, BLOCK, PIVOTS)
        if GOAL_IS_FRACTION:
            target = tl.where(passes == 0, goal * _at_first_pivot(reach, PIVOTS), target)
        lo, hi = _narrowed(lo, hi, pivot_bits, reach, target, smallest, largest)
        passes += 1
    return lo.to(tl.float32, bitcast=True)


@triton.jit
def _search_start_kernel(
    temperature_ptr, goal_ptr, chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr,
    row_max_ptr, lo_ptr, hi_ptr, target_ptr,
    VOCAB: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr,
    GOAL_IS_FRACTION: tl.constexpr, AFTER_ANOTHER: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A row's bracket for one filter of the split search: from its smallest weight, or AFTER_ANOTHER
    from the threshold the filter before it found, up to 1; closed at once where the row is greedy or
    this filter keeps every token."""
    begin(DEPENDENT)
    row = tl.program_id(0)
    temperature, scale = _temperature_scale(temperature_ptr, row, True)
    if AFTER_ANOTHER:
        lo = tl.load(lo_ptr + row)
    else:
        row_max, _, row_min, _, _ = _row_statistics(
            row, chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_sum_ptr, scale, CHUNKS,
            CHUNKS_POW2, False)
        lo = tl.exp2((row_min - row_max) * scale).to(tl.int32, bitcast=True)
        tl.store(row_max_ptr + row, row_max)
    goal = tl.load(goal_ptr + row)
    if GOAL_IS_FRACTION:
        filters = goal < 1.0
    else:
        filters = (goal > 0) & (goal < VOCAB)
    tl.store(lo_ptr + row, lo)
    tl.store(hi_ptr + row, tl.where((temperature > 0) & filters, _ONE_BITS + 1, lo + 1))
    tl.store(target_ptr + row, goal.to(tl.float64))


@triton.jit
def _search_pass_kernel(
    logits_ptr, row_stride, temperature_ptr, row_max_ptr, lo_ptr, hi_ptr, reach_ptr, smallest_ptr, largest_ptr,
    VOCAB: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
    GOAL_IS_FRACTION: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A (row, chunk) program of a split search pass: F at the row's pivots over its chunk, and the
    smallest and largest weight of the chunk inside the bracket. Rows whose bracket closed stop."""
    begin(DEPENDENT)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    if hi - lo > 1:
        _, scale = _temperature_scale(temperature_ptr, row, True)
        pivot_bits = _pivot_bits(lo, hi, PIVOTS)
        reach, smallest, largest = _reach(
            logits_ptr + row.to(tl.int64) * row_stride, chunk * CHUNK, chunk * CHUNK + CHUNK, VOCAB,
            tl.load(row_max_ptr + row), scale, lo, hi, pivot_bits, GOAL_IS_FRACTION, BLOCK, PIVOTS)
        at = row * CHUNKS + chunk
        tl.store(reach_ptr + at * PIVOTS + tl.arange(0, PIVOTS), reach)
        tl.store(smallest_ptr + at, smallest)
        tl.store(largest_ptr + at, largest)


@triton.jit
def _search_narrow_kernel(
    lo_ptr, hi_ptr, target_ptr, reach_ptr, smallest_ptr, largest_ptr,
    CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, PIVOTS: tl.constexpr,
    GOAL_IS_FRACTION: tl.constexpr, FIRST_PASS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A row's bracket after a split search pass, from its chunks' results (as _threshold's pass)."""
    begin(DEPENDENT)
    row = tl.program_id(0)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    if hi - lo > 1:
        chunks = tl.arange(0, CHUNKS_POW2)
        held = chunks < CHUNKS
        at = row * CHUNKS + chunks
        reach = tl.sum(tl.load(reach_ptr + at[:, None] * PIVOTS + tl.arange(0, PIVOTS)[None, :],
                               mask=held[:, None], other=0.0), axis=0)
        smallest = tl.min(tl.load(smallest_ptr + at, mask=held, other=float("inf")), axis=0)
        largest = tl.max(tl.load(largest_ptr + at, mask=held, other=-1.0), axis=0)
        target = tl.load(target_ptr + row)
        if GOAL_IS_FRACTION & FIRST_PASS:
            target = target * _at_first_pivot(reach, PIVOTS)
            tl.store(target_ptr + row, target)
        lo, hi = _narrowed(lo, hi, _pivot_bits(lo, hi, PIVOTS), reach, target, smallest, largest)
        tl.store(lo_ptr + row, lo)
        tl.store(hi_ptr + row, hi)


@triton.jit
def _inverse_cdf(row_ptr, VOCAB: tl.constexpr, row_max, scale, threshold, uniform, fallback_id,
                 BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """The first id, in id order, whose cumulative candidate weight exceeds uniform times the
    candidates' total. One pass keeps every block's candidate mass in registers; the draw then
    picks its block from their running sum and scans only that block."""
    offsets = tl.arange(0, BLOCK)
    block_index = tl.arange(0, NUM_BLOCKS)
    block_mass = tl.zeros([NUM_BLOCKS], tl.float64)
    for block in range(0, tl.cdiv(VOCAB, BLOCK)):
        w = _weights(row_ptr, block * BLOCK + offsets, VOCAB, row_max, scale)
        mass = tl.sum(tl.where(w >= threshold, w, 0.0).to(tl.float64), axis=0)
        block_mass = tl.where(block_index == block, mass, block_mass)
    mass_through = tl.cumsum(block_mass, axis=0)
    target = uniform * tl.max(mass_through, axis=0)
    landing = tl.sum((mass_through <= target).to(tl.int32), axis=0)
    landing = tl.minimum(landing, tl.cdiv(VOCAB, BLOCK) - 1)
    mass_before = tl.max(tl.where(block_index < landing, mass_through, 0.0), axis=0)

    ids = landing * BLOCK + offsets
    w = _weights(row_ptr, ids, VOCAB, row_max, scale)
    candidate = w >= threshold
    running = mass_before + tl.cumsum(tl.where(candidate, w, 0.0).to(tl.float64), axis=0)
    first = tl.min(tl.where(candidate & (running > target), ids, _NO_ID), axis=0)
    # Rounding may leave the block's running sum short of the target: its last candidate takes it.
    last = tl.max(tl.where(candidate, ids, -1), axis=0)
    return tl.where(first != _NO_ID, first, tl.where(last >= 0, last, fallback_id))


@triton.jit
def _among_candidates(by_weight_ptr, by_id_ptr, ids_ptr, row_max, scale, scaled_total, top_k, top_p, min_p,
                      uniform, VOCAB: tl.constexpr, CANDIDATES: tl.constexpr):
    """The draw among a row's CANDIDATES most probable tokens (their logits by decreasing value, and
    again in increasing id order beside their ids), and whether it stands: whether the top-k and
    top-p threshold lies strictly above the least candidate's weight, so that every token at or above
    it is a candidate. Thresholds are as in _threshold: the k-th largest weight, then the largest
    weight at or above which the weights reach top_p of the mass left by top-k."""
    slot = tl.arange(0, CANDIDATES)
    weight = tl.exp2((tl.load(by_weight_ptr + slot).to(tl.float32) - row_max) * scale)
    least = tl.min(weight, axis=0)
    threshold = least
    found = tl.full([], 1, tl.int1)
    mass = scaled_total
    if (top_k > 0) & (top_k < VOCAB):
        found = top_k <= CANDIDATES
        threshold = tl.sum(tl.where(slot == top_k - 1, weight, 0.0), axis=0)
        mass = tl.sum(tl.where(weight >= threshold, weight, 0.0).to(tl.float64), axis=0)
    if top_p < 1.0:
        kept = weight >= threshold
        running = tl.cumsum(tl.where(kept, weight, 0.0).to(tl.float64), axis=0)
        reaching = tl.min(tl.where(kept & (running >= top_p.to(tl.float64) * mass), slot, CANDIDATES), axis=0)
        found = found & (reaching < CANDIDATES)
        threshold = tl.maximum(threshold, tl.sum(tl.where(slot == reaching, weight, 0.0), axis=0))
    stands = found & (threshold > least)
    threshold = tl.maximum(threshold, tl.minimum(min_p, 1.0))

    ids = tl.load(ids_ptr + slot).to(tl.int32)
    weight = tl.exp2((tl.load(by_id_ptr + slot).to(tl.float32) - row_max) * scale)
    candidate = weight >= threshold
    running = tl.cumsum(tl.where(candidate, weight, 0.0).to(tl.float64), axis=0)
    target = uniform * tl.max(running, axis=0)
    first = tl.min(tl.where(candidate & (running > target), ids, _NO_ID), axis=0)
    last = tl.max(tl.where(candidate, ids, -1), axis=0)
    return tl.where(first != _NO_ID, first, last), stands


@triton.jit
def _sample_rows(
    logits_ptr, row_stride,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, uniform_ptr,
    token_ids_ptr, logprobs_ptr, normaliser_ptr,
    by_weight_ptr, by_id_ptr, candidate_ids_ptr,
    chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_scaled_sum_ptr, searched_ptr,
    VOCAB: tl.constexpr, ROW_BLOCK: tl.constexpr, NUM_ROW_BLOCKS: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr,
    PIVOTS: tl.constexpr, MAX_SEARCH_PASSES: tl.constexpr, CANDIDATES: tl.constexpr,
    ANY_RANDOM: tl.constexpr, ANY_RANK_FILTER: tl.constexpr, USE_CANDIDATES: tl.constexpr,
    SEARCHED: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A row's draw, its logprob and log-sum-exp. With SEARCHED the split search has left each row's
    top-k and top-p threshold (as a bit pattern) at searched_ptr."""
    begin(DEPENDENT)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    temperature, scale = _temperature_scale(temperature_ptr, row, ANY_RANDOM)
    row_max, chosen, row_min, normaliser, scaled_total = _row_statistics(
        row, chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_scaled_sum_ptr, scale, CHUNKS,
        CHUNKS_POW2, USE_CANDIDATES)
    if ANY_RANDOM:
        if temperature > 0:
            # The smallest weight: every token is a candidate until a filter raises the threshold.
            threshold = tl.exp2((row_min - row_max) * scale)
            min_p = tl.load(min_p_ptr + row).to(tl.float32)
            uniform = tl.load(uniform_ptr + row).to(tl.float64)
            searching = tl.full([], 1, tl.int1)
            if SEARCHED:
                threshold = tl.load(searched_ptr + row).to(tl.float32, bitcast=True)
            elif ANY_RANK_FILTER:
                top_k = tl.load(top_k_ptr + row)
                top_p = tl.load(top_p_ptr + row)
                if USE_CANDIDATES:
                    if (top_k > 0) & (top_k < VOCAB) | (top_p < 1.0):
                        offset = row.to(tl.int64) * CANDIDATES
                        drawn, stands = _among_candidates(
                            by_weight_ptr + offset, by_id_ptr + offset, candidate_ids_ptr + offset, row_max, scale,
                            scaled_total, top_k, top_p, min_p, uniform, VOCAB, CANDIDATES)
                        chosen = tl.where(stands, drawn, chosen)
                        searching = ~stands
                if searching:
                    if (top_k > 0) & (top_k < VOCAB):
                        threshold = _threshold(row_ptr, VOCAB, row_max, scale, threshold, top_k.to(tl.float64),
                                               False, SEARCH_BLOCK, PIVOTS, MAX_SEARCH_PASSES)
                    if top_p < 1.0:
                        threshold = _threshold(row_ptr, VOCAB, row_max, scale, threshold, top_p.to(tl.float64),
                                               True, SEARCH_BLOCK, PIVOTS, MAX_SEARCH_PASSES)
            if searching:
                # min_p relative to the top weight, which is 1; capped so that the top token stays.
                threshold = tl.maximum(threshold, tl.minimum(min_p, 1.0))
                chosen = _inverse_cdf(row_ptr, VOCAB, row_max, scale, threshold, uniform, chosen,
                                      ROW_BLOCK, NUM_ROW_BLOCKS)
    chosen_logit = tl.load(row_ptr + chosen).to(tl.float32)
    tl.store(token_ids_ptr + row, chosen)
    tl.store(logprobs_ptr + row, chosen_logit - normaliser)
    tl.store(normaliser_ptr + row, normaliser)


def sample(logits: torch.Tensor, params: TorchSampling) -> SampleResult:
    """`Ops.sample` on logits [B, V] (float32, float16 or bfloat16) with prepared parameters."""
    rows, vocab = logits.shape
    penalised = (params.has_bias or params.has_repetition_penalty or params.has_count_penalties
                 or params.allowed_token_mask is not None)
    x = _penalised_logits(logits, params) if penalised else logits
    if x.stride(1) != 1:
        x = x.contiguous()
    device = x.device
    token_ids = torch.empty(rows, dtype=torch.int32, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    normaliser = torch.empty(rows, dtype=torch.float32, device=device)
    if rows:
        row_block = min(ROW_BLOCK, triton.next_power_of_2(vocab))
        use_candidates = params.needs_sort and vocab > CANDIDATES and rows <= CANDIDATE_ROWS
        split_search = params.needs_sort and not use_candidates and vocab > SEARCH_CHUNK
        by_weight = by_id = candidate_ids = x
        if use_candidates:
            by_weight, by_weight_ids = torch.topk(x, CANDIDATES, dim=1)
            candidate_ids, order = torch.sort(by_weight_ids, dim=1)
            by_id = torch.gather(by_weight, 1, order)
        statistics = _chunk_statistics_of(x, params, row_block, scaled_sum=use_candidates)
        chunks = statistics[0].shape[1]
        searched = _split_search(x, params, statistics) if split_search else token_ids
        _sample_rows[(rows,)](
            x, x.stride(0),
            params.temperature, params.top_k, params.top_p, params.min_p, params.uniform,
            token_ids, logprobs, normaliser,
            by_weight, by_id, candidate_ids,
            *statistics, searched,
            VOCAB=vocab,
            ROW_BLOCK=row_block,
            NUM_ROW_BLOCKS=triton.next_power_of_2(triton.cdiv(vocab, row_block)),
            SEARCH_BLOCK=min(SEARCH_BLOCK, triton.next_power_of_2(vocab)),
            CHUNKS=chunks,
            CHUNKS_POW2=triton.next_power_of_2(chunks),
            PIVOTS=PIVOTS,
            MAX_SEARCH_PASSES=MAX_SEARCH_PASSES,
            CANDIDATES=CANDIDATES,
            ANY_RANDOM=params.random_rows is not None,
            ANY_RANK_FILTER=params.needs_sort,
            USE_CANDIDATES=use_candidates,
            SEARCHED=split_search,
            num_warps=NUM_WARPS,
            **launch_options(device),
        )
    top_ids, top_logprobs = _top_logprobs(x, lambda values: values - normaliser[:, None], params.num_top_logprobs)
    return SampleResult(token_ids=token_ids, logprobs=logprobs, top_token_ids=top_ids, top_logprobs=top_logprobs)


def _chunk_statistics_of(x: torch.Tensor, params: TorchSampling, row_block: int, scaled_sum: bool) -> list:
    """Each row's chunks' maximum, its first id, minimum, sum of exponentials and, with `scaled_sum`,
    the weights' total at the row's temperature (which only the draw among candidates reads): [rows,
    chunks] each."""
    rows, vocab = x.shape
    chunk = STATISTICS_BLOCKS * row_block
    chunks = triton.cdiv(vocab, chunk)
    statistics = [torch.empty(rows, chunks, dtype=dtype, device=x.device)
                  for dtype in (torch.float32, torch.int32, torch.float32, torch.float32)]
    statistics.append(torch.empty(rows, chunks, dtype=torch.float64, device=x.device) if scaled_sum
                      else statistics[-1])
    _chunk_statistics_kernel[(rows, chunks)](
        x, x.stride(0), params.temperature, *statistics,
        VOCAB=vocab, ROW_BLOCK=row_block, CHUNK=chunk, CHUNKS=chunks,
        ANY_RANDOM=params.random_rows is not None, SCALED_SUM=scaled_sum,
        num_warps=STATISTICS_WARPS, **launch_options(x.device),
    )
    return statistics


def _split_search(x: torch.Tensor, params: TorchSampling, statistics: list[torch.Tensor]) -> torch.Tensor:
    """Each row's top-k and then top-p threshold, as float32 bit patterns (int32), found by passes split
    over (row, SEARCH_CHUNK) programs with each row's bracket kept in memory between launches."""
    rows, vocab = x.shape
    device = x.device
    chunks = triton.cdiv(vocab, SEARCH_CHUNK)
    row_max = torch.empty(rows, dtype=torch.float32, device=device)
    lo, hi = (torch.empty(rows, dtype=torch.int32, device=device) for _ in range(2))
    target = torch.empty(rows, dtype=torch.float64, device=device)
    reach = torch.empty(rows, chunks, PIVOTS, dtype=torch.float64, device=device)
    smallest, largest = (torch.empty(rows, chunks, dtype=torch.float32, device=device) for _ in range(2))
    statistic_chunks = statistics[0].shape[1]
    filters = [(goal, fraction) for goal, fraction, used in
               ((params.top_k, False, params.has_top_k), (params.top_p, True, params.has_top_p)) if used]
    for index, (goal, fraction) in enumerate(filters):
        _search_start_kernel[(rows,)](
            params.temperature, goal, *statistics[:4], row_max, lo, hi, target,
            VOCAB=vocab, CHUNKS=statistic_chunks, CHUNKS_POW2=triton.next_power_of_2(statistic_chunks),
            GOAL_IS_FRACTION=fraction, AFTER_ANOTHER=index > 0, **launch_options(device),
        )
        for search_pass in range(SPLIT_SEARCH_PASSES):
            _search_pass_kernel[(rows, chunks)](
                x, x.stride(0), params.temperature, row_max, lo, hi, reach, smallest, largest,
                VOCAB=vocab, CHUNK=SEARCH_CHUNK, CHUNKS=chunks, BLOCK=min(SEARCH_BLOCK, SEARCH_CHUNK), PIVOTS=PIVOTS,
                GOAL_IS_FRACTION=fraction, num_warps=NUM_WARPS, **launch_options(device),
            )
            _search_narrow_kernel[(rows,)](
                lo, hi, target, reach, smallest, largest,
                CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), PIVOTS=PIVOTS,
                GOAL_IS_FRACTION=fraction, FIRST_PASS=search_pass == 0, **launch_options(device),
            )
    return lo
