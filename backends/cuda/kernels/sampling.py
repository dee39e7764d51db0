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
over probability values instead of a sort, each pass a stream over the row. On an H200 at a 152k
vocabulary, top-p 0.9 took 0.81 ms a row searching the whole row, 0.31 among candidates; greedy 0.09,
when one program a row also walked the row for its statistics (not yet measured split).
Nothing here waits for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
):
    """A (row, chunk) program: its chunk's statistics, for _sample_rows to combine."""
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
def _threshold(row_ptr, VOCAB: tl.constexpr, row_max, scale, floor, goal, GOAL_IS_FRACTION: tl.constexpr,
               BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The largest t >= floor with F(t) >= target, F(t) the number (count mode) or the summed
    weight (fraction mode) of the weights w >= t; target is `goal`, or in fraction mode `goal`
    times F(floor). That t is always one of the weights, so the candidates are exactly w >= t.

    The search keeps a bracket [lo, hi) of float32 bit patterns (monotonic for w >= 0) with
    F(lo) >= target > F(hi). Each pass evaluates F at PIVOTS points spread over the bracket, lo
    included, and also notes the smallest and largest weight inside it, so that the bracket
    shrinks to the data it holds and closes at once when that is a single value.
    """
    offsets = tl.arange(0, BLOCK)
    pivot_index = tl.arange(0, PIVOTS)
    lo = floor.to(tl.int32, bitcast=True)
    hi = tl.full([], _ONE_BITS + 1, tl.int32)
    target = goal
    passes = tl.full([], 0, tl.int32)
    while (hi - lo > 1) & (passes < MAX_PASSES):
        width = (hi - lo).to(tl.int64)
        pivot_bits = lo + ((width * pivot_index) // PIVOTS).to(tl.int32)
        pivots = pivot_bits.to(tl.float32, bitcast=True)
        lo_value = lo.to(tl.float32, bitcast=True)
        hi_value = hi.to(tl.float32, bitcast=True)
        lane_reach = tl.zeros([BLOCK, PIVOTS], tl.float32)
        lane_smallest = tl.full([BLOCK], float("inf"), tl.float32)
        lane_largest = tl.full([BLOCK], -1.0, tl.float32)
        for start in range(0, VOCAB, BLOCK):
            ids = start + offsets
            x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=0.0).to(tl.float32)
            w = tl.where(ids < VOCAB, tl.exp2((x - row_max) * scale), -1.0)
            at_or_above = w[:, None] >= pivots[None, :]
            if GOAL_IS_FRACTION:
                lane_reach += tl.where(at_or_above, w[:, None], 0.0)
            else:
                lane_reach += at_or_above.to(tl.float32)
            inside = (w >= lo_value) & (w < hi_value)
            lane_smallest = tl.minimum(lane_smallest, tl.where(inside, w, float("inf")))
            lane_largest = tl.maximum(lane_largest, tl.where(inside, w, -1.0))
        reach = tl.sum(lane_reach.to(tl.float64), axis=0)
        if GOAL_IS_FRACTION:
            reach_at_lo = tl.sum(tl.where(pivot_index == 0, reach, 0.0), axis=0)
            target = tl.where(passes == 0, goal * reach_at_lo, target)
        reached = reach >= target
        new_hi = tl.minimum(hi, tl.min(tl.where(reached, hi, pivot_bits), axis=0))
        new_lo = tl.max(tl.where(reached & (pivot_bits < new_hi), pivot_bits, lo), axis=0)
        # No weight lies in [lo, smallest) or (largest, hi), so F is flat there.
        new_lo = tl.maximum(new_lo, tl.min(lane_smallest, axis=0).to(tl.int32, bitcast=True))
        new_hi = tl.minimum(new_hi, tl.max(lane_largest, axis=0).to(tl.int32, bitcast=True) + 1)
        lo = new_lo
        hi = tl.maximum(new_hi, new_lo + 1)
        passes += 1
    return lo.to(tl.float32, bitcast=True)


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
        ids = block * BLOCK + offsets
        x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=0.0).to(tl.float32)
        w = tl.where(ids < VOCAB, tl.exp2((x - row_max) * scale), -1.0)
        mass = tl.sum(tl.where(w >= threshold, w, 0.0).to(tl.float64), axis=0)
        block_mass = tl.where(block_index == block, mass, block_mass)
    mass_through = tl.cumsum(block_mass, axis=0)
    target = uniform * tl.max(mass_through, axis=0)
    landing = tl.sum((mass_through <= target).to(tl.int32), axis=0)
    landing = tl.minimum(landing, tl.cdiv(VOCAB, BLOCK) - 1)
    mass_before = tl.max(tl.where(block_index < landing, mass_through, 0.0), axis=0)

    ids = landing * BLOCK + offsets
    x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=0.0).to(tl.float32)
    w = tl.where(ids < VOCAB, tl.exp2((x - row_max) * scale), -1.0)
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
    chunk_max_ptr, chunk_max_id_ptr, chunk_min_ptr, chunk_sum_ptr, chunk_scaled_sum_ptr,
    VOCAB: tl.constexpr, ROW_BLOCK: tl.constexpr, NUM_ROW_BLOCKS: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr,
    PIVOTS: tl.constexpr, MAX_SEARCH_PASSES: tl.constexpr, CANDIDATES: tl.constexpr,
    ANY_RANDOM: tl.constexpr, ANY_RANK_FILTER: tl.constexpr, USE_CANDIDATES: tl.constexpr,
):
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
            if ANY_RANK_FILTER:
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
        by_weight = by_id = candidate_ids = x
        if use_candidates:
            by_weight, by_weight_ids = torch.topk(x, CANDIDATES, dim=1)
            candidate_ids, order = torch.sort(by_weight_ids, dim=1)
            by_id = torch.gather(by_weight, 1, order)
        chunk = STATISTICS_BLOCKS * row_block
        chunks = triton.cdiv(vocab, chunk)
        statistics = [torch.empty(rows, chunks, dtype=dtype, device=device)
                      for dtype in (torch.float32, torch.int32, torch.float32, torch.float32)]
        # the weights' totals at the rows' temperatures, which only the draw among candidates reads
        statistics.append(torch.empty(rows, chunks, dtype=torch.float64, device=device) if use_candidates
                          else statistics[-1])
        _chunk_statistics_kernel[(rows, chunks)](
            x, x.stride(0), params.temperature, *statistics,
            VOCAB=vocab, ROW_BLOCK=row_block, CHUNK=chunk, CHUNKS=chunks,
            ANY_RANDOM=params.random_rows is not None, SCALED_SUM=use_candidates,
            num_warps=STATISTICS_WARPS,
        )
        _sample_rows[(rows,)](
            x, x.stride(0),
            params.temperature, params.top_k, params.top_p, params.min_p, params.uniform,
            token_ids, logprobs, normaliser,
            by_weight, by_id, candidate_ids,
            *statistics,
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
            num_warps=NUM_WARPS,
        )
    top_ids, top_logprobs = _top_logprobs(x, normaliser[:, None], params.num_top_logprobs)
    return SampleResult(token_ids=token_ids, logprobs=logprobs, top_token_ids=top_ids, top_logprobs=top_logprobs)
