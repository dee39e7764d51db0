"""How the GEMV and GEMM kernels that split K across programs finish a launch: each program stores its
float32 partial sums, and the last to arrive at an output tile adds them all, in split order, so the sum
does not depend on which finishes first. One launch in all, no reduction kernel after it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.kernels.activations import NO_GATE, activate


@triton.jit
def finish_tile(acc, out_ptr, bias_ptr, partials_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask, N,
                out_row_stride, partials_split_stride, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                squares, squares_ptr, width, eps, NORM: tl.constexpr, GATE_OUT: tl.constexpr = NO_GATE):
    """Store a program's float32 [rows, cols] tile (plus the bias over cols where HAS_BIAS), or with K
    split, its partial sum: the program that arrives last at its output tile adds them all, in split order,
    adds the bias, writes the tile and resets the tile's arrival count for the next launch.
    With NORM (a one-row tile of a GEMV normalising x as it loads it) the sums are of x times the norm's
    weight, and `squares` the sum of x's squares over the program's share of K: the tile is scaled by the
    row's 1 / rms, from every split's squares (kept at `squares_ptr`, a float32 a split and tile).
    With GATE_OUT an activation kind, the tile's columns are (gate, up) pairs of a gated MLP's first
    projection (`paired_rows`), and each pair is written as one gated value (`store_tile`)."""
    out_mask = row_mask[:, None] & col_mask[None, :]
    if not SPLIT:
        if NORM:
            acc *= inverse_rms(squares, width, eps)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        store_tile(acc, out_ptr, rows, cols, out_mask, out_row_stride, GATE_OUT)
    else:
        partial_offsets = rows[:, None] * N + cols[None, :]
        tl.store(partials_ptr + split * partials_split_stride + partial_offsets, acc, mask=out_mask)
        splits = tl.num_programs(1)
        tiles = tl.num_programs(0) * tl.num_programs(2)
        if NORM:
            tl.store(squares_ptr + split * tiles + tile, squares)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            row_squares = 0.0
            for other in range(splits):
                total += tl.load(partials_ptr + other * partials_split_stride + partial_offsets, mask=out_mask,
                                 other=0.0, cache_modifier=".cg")
                if NORM:
                    row_squares += tl.load(squares_ptr + other * tiles + tile, cache_modifier=".cg")
            if NORM:
                total *= inverse_rms(row_squares, width, eps)
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            store_tile(total, out_ptr, rows, cols, out_mask, out_row_stride, GATE_OUT)
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


MAX_SPLIT_K = 16
# Each split's share of K, in steps: fewer and the partial sums cost more than they save.
MIN_STEPS_PER_SPLIT = 2


def steps_a_split(steps: int, split_k: int) -> int:
    """The steps along K each of `split_k` splits of `steps` takes, ceil(steps / split_k): the last split
    takes what is left, fewer where they do not divide (a K of 37 steps, Qwen2.5-7B's down projection in
    steps of 512, splits 8, 8, 8, 8 and 5 ways in five). ValueError where a split would take none."""
    if not splittable(steps, split_k):
        raise ValueError(f"{steps} steps along K cannot be split {split_k} ways with a step for each")
    return -(-steps // split_k)


def splittable(steps: int, split_k: int) -> bool:
    """Whether each of `split_k` splits of `steps` steps takes at least one (see steps_a_split)."""
    return steps >= 1 and 1 <= split_k and (split_k - 1) * -(-steps // split_k) < steps


def splits_for(tiles: int, steps: int, programs: int, most_splits: int = MAX_SPLIT_K) -> int:
    """The fewest splits of `steps` steps along K that give `tiles` output tiles `programs` programs, or as
    many as `most_splits`, MAX_SPLIT_K and MIN_STEPS_PER_SPLIT allow: a divisor of the steps where one
    gives enough, else splits whose last takes fewer steps (K of a prime number of steps kept whole left
    an H200's SMs with one or two programs each)."""
    allowed = [split for split in range(1, min(most_splits, MAX_SPLIT_K) + 1)
               if split == 1 or (splittable(steps, split) and steps // split >= MIN_STEPS_PER_SPLIT)]
    even = [split for split in allowed if steps % split == 0]
    for candidates in (even, allowed):
        enough = [split for split in candidates if tiles * split >= programs]
        if enough:
            return enough[0]
    return allowed[-1]


@triton.jit
def store_tile(values, out_ptr, rows, cols, mask, out_row_stride, GATE_OUT: tl.constexpr):
    """Write a finished float32 [rows, cols] tile to out[rows, cols]; with GATE_OUT an activation kind, a tile
    of (gate, up) pairs (`paired_rows`) as act(gate) * up at the gate's column, which is its gated value's."""
    if GATE_OUT == NO_GATE:
        tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], values.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        ROWS: tl.constexpr = values.shape[0]
        PAIRS: tl.constexpr = values.shape[1] // 2
        gate, up = tl.split(tl.reshape(values, (ROWS, PAIRS, 2)))
        gate_cols, _ = tl.split(tl.reshape(cols, (PAIRS, 2)))
        held, _ = tl.split(tl.reshape(mask, (ROWS, PAIRS, 2)))
        tl.store(out_ptr + rows[:, None] * out_row_stride + gate_cols[None, :],
                 (activate(gate, GATE_OUT) * up).to(out_ptr.dtype.element_ty), mask=held)


@triton.jit
def paired_rows(tile_n, BLOCK_N: tl.constexpr, N, GATE_OUT: tl.constexpr):
    """The weight rows of a GEMV's output tile `tile_n` and which of them exist: BLOCK_N rows in turn, or with
    GATE_OUT an activation kind (a gated MLP's first projection, its N rows the gate's then the up's), the
    tile's BLOCK_N / 2 gate rows each followed by its up row, N / 2 on, for `store_tile` to gate in pairs."""
    if GATE_OUT == NO_GATE:
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return cols, cols < N
    else:
        lanes = tl.arange(0, BLOCK_N)
        inner = N // 2
        gate = tile_n * (BLOCK_N // 2) + lanes // 2
        return gate + (lanes % 2) * inner, gate < inner


@triton.jit
def finish_gemv_row(result, out_ptr, bias_ptr, partials_ptr, arrivals_ptr, row, tile_n, split, cols, col_mask, N,
                    out_row_stride, partials_split_stride, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    squares, squares_ptr, width, eps, NORM: tl.constexpr, GATE_OUT: tl.constexpr = NO_GATE):
    """`finish_tile` for a GEMV program's [BLOCK_N] outputs `cols` of x's row `row`, its grid (column
    tiles, splits of K, rows)."""
    rows = row + tl.arange(0, 1)
    tile = row * tl.num_programs(0) + tile_n
    finish_tile(result[None, :], out_ptr, bias_ptr, partials_ptr, arrivals_ptr, tile, split, rows, cols, rows >= 0,
                col_mask, N, out_row_stride, partials_split_stride, SPLIT, HAS_BIAS, squares, squares_ptr, width, eps,
                NORM, GATE_OUT)


@triton.jit
def inverse_rms(squares, width, eps):
    """1 / rms of a row of `width` values whose squares sum to `squares`, as the norm's kernel computes it."""
    return 1.0 / tl.sqrt(squares / width + eps)


# Per device, zeroed counters of the split programs that have finished each output tile; the last
# one resets its tile's to zero. A buffer is never freed (a captured graph may point at it): a larger
# launch takes a new, larger one.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []
MIN_ARRIVAL_COUNTERS = 4096


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for at least `tiles` output tiles on `device`, the same memory ever after."""
    device = torch.device(device)
    counts = _ARRIVALS.get(device)
    if counts is None or counts.numel() < tiles:
        counts = torch.zeros(max(MIN_ARRIVAL_COUNTERS, triton.next_power_of_2(tiles)), dtype=torch.int32,
                             device=device)
        _KEPT.append(counts)
        _ARRIVALS[device] = counts
    return counts


def partial_squares(out: torch.Tensor, split_k: int, tiles: int, normalising: bool) -> torch.Tensor:
    """The float32 [split_k, tiles] buffer a normalising GEMV with K split `split_k` ways keeps each split's
    sum of squares of x in, per output tile; `out` itself where it keeps none."""
    if split_k == 1 or not normalising:
        return out
    return torch.empty(split_k, tiles, dtype=torch.float32, device=out.device)


def partial_sums(out: torch.Tensor, split_k: int, columns: int | None = None) -> torch.Tensor:
    """The float32 [split_k, rows, columns] buffer a launch with K split `split_k` ways stores its partial
    sums in, columns out's unless given (a gated output's weight has twice as many rows as it); `out` itself
    without a split (the kernels then touch neither)."""
    if split_k == 1:
        return out
    return torch.empty(split_k, out.shape[0], out.shape[1] if columns is None else columns, dtype=torch.float32,
                       device=out.device)
