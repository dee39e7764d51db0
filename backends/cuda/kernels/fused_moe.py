"""`Ops.moe_experts` as Triton kernels: each token's K experts' gated SiLU MLPs, summed by routing
weight, in five launches that never wait for the host, so that a decode step of a mixture-of-experts
model can be captured in a CUDA graph.

The T x K (token, expert) picks are sorted by expert on the device: each expert's picks, in pick
order, fill whole tiles of BLOCK_M rows, its last tile padded. How many tiles the experts fill
depends on the routing, so every grid is sized for the most they can: P + min(E, P) (BLOCK_M - 1)
rows for P picks of E experts (each expert used pads at most BLOCK_M - 1 rows). A program of a
tile past the last one used returns at once.

1. `_count_picks_kernel`: how many picks of each expert each chunk of CHUNK picks holds.
2. `_place_picks_kernel`: from those counts, each expert's first row (the tiles of the experts
   before it) and each chunk's first row within it; the chunk's picks go to their rows, and each
   tile is told its expert (-1 past the last used tile) and how many of its rows hold picks.
3. `_gate_up_kernel`: a tile's rows of x (gathered by token) times its expert's gate and up rows,
   into two float32 accumulators side by side; silu(gate) * up in registers, rounded to x's dtype
   (the op rounds each expert's activation as a dense MLP's `silu_and_mul` does).
4. `_down_kernel`: those activations times the expert's down rows, times each pick's routing weight:
   one float32 row per pick.
5. `_sum_picks_kernel`: each token's K rows added in float32, in pick order, rounded once.

A row per pick and then one sum, rather than float32 atomic adds into a row per token: the sum is
the op's, over j in order, and gives the same bits whichever tile finishes first, so a replayed
graph, an op-by-op step and a rerun agree exactly. It costs P x H float32 of scratch (64 MiB for a
1,024-token chunk of Qwen3-30B-A3B's top-8 of hidden 2,048; atomics would need a K-th of it) and
one more launch that reads it back.

A pick whose expert id, less `first_expert`, is outside [0, E) adds nothing to its token and
fills no tile: under tensor parallelism, another rank's expert (`route_experts` never makes one
otherwise; the device cannot raise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.availability import interpreting
from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options

# Picks a sorting program takes; the second launch reads every chunk's counts, so fewer, larger
# chunks keep that cheap at prefill sizes (64 chunks for 2,048 tokens of top-8).
SORT_CHUNK = 256
# Elements of the [picks, experts] one-hot matrices the sorting kernels hold at once.
SORT_ONE_HOT_ELEMENTS = 2048
SUM_BLOCK = 1024


@dataclass(frozen=True)
class MoeTiles:
    """One call's tiling: BLOCK_M rows (picks of one expert) a tile, and each GEMM program an
    output block of block_n columns (of I for gate_up, each of gate and up; of H for down), block_k
    values of the reduction a step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Under the interpreter every program runs in numpy: small tiles keep the test widths (hidden 64,
# intermediate 32 to 128) several column blocks and reduction steps wide, ragged ones included.
INTERPRETER_TILES = MoeTiles(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def choose_tiles(picks: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """The tiling for P picks of E experts in `dtype` (a fixed one under the interpreter). Picks
    per used expert decide the rows of a tile: a decode's few fill 16-row tiles, the smallest a dot
    takes, with wide weight blocks to stream each expert's bytes; a prefill's hundreds take the
    usual GEMM tiles. float32 runs on the FMA units, where two [BLOCK_M, BLOCK_N] accumulators and
    their operands take far more registers: 16 x 32 tiles. ptxas builds every tile here for sm_90a and
    sm_80 without spills (compile_check.SPILL_FREE holds sm_90a to that). Not yet timed on a GPU."""
    if interpreting():
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return MoeTiles(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    rows_per_expert = picks / max(1, min(num_experts, picks))
    if rows_per_expert <= 16:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def row_bound(picks: int, num_experts: int, block_m: int) -> int:
    """The most rows P picks of E experts can fill in tiles of `block_m`: P, and at most
    block_m - 1 padding rows for each expert used, of which there are at most min(E, P)."""
    return picks + min(num_experts, picks) * (block_m - 1)


@dataclass(frozen=True)
class SortedPicks:
    """The picks in expert order, as the GEMM kernels read them: for tile t, rows t * BLOCK_M on."""

    rows: torch.Tensor  # int32 [tiles * BLOCK_M]: the pick (t * K + j) in each row; padding rows unwritten
    tile_experts: torch.Tensor  # int32 [tiles]: each tile's expert, -1 past the last tile used
    tile_rows: torch.Tensor  # int32 [tiles]: how many of each tile's rows, from its first, hold picks
    block_m: int

    @property
    def tiles(self) -> int:
        return self.tile_experts.shape[0]


def sort_picks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPicks:
    """expert_ids [P] int32 (contiguous) sorted by expert into tiles of `block_m` rows, on the
    device, in two launches sized by P, E and block_m alone."""
    picks = expert_ids.shape[0]
    tiles = triton.cdiv(row_bound(picks, num_experts, block_m), block_m)
    device = expert_ids.device
    rows = torch.empty(tiles * block_m, dtype=torch.int32, device=device)
    tile_experts = torch.empty(tiles, dtype=torch.int32, device=device)
    tile_rows = torch.empty(tiles, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    sub = min(SORT_CHUNK, max(16, SORT_ONE_HOT_ELEMENTS // block_e))
    chunks = triton.cdiv(picks, SORT_CHUNK)
    chunk_counts = torch.empty(chunks, block_e, dtype=torch.int32, device=device)
    _count_picks_kernel[(chunks,)](expert_ids, chunk_counts, picks, num_experts,
                                   BLOCK_E=block_e, CHUNK=SORT_CHUNK, SUB=sub, **launch_options(device))
    _place_picks_kernel[(chunks,)](expert_ids, chunk_counts, rows, tile_experts, tile_rows,
                                   picks, num_experts, chunks, tiles, triton.cdiv(tiles, chunks), block_m,
                                   BLOCK_E=block_e, CHUNK=SORT_CHUNK, SUB=sub, **launch_options(device))
    return SortedPicks(rows, tile_experts, tile_rows, block_m)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, tiles: MoeTiles | None = None, first_expert: int = 0) -> torch.Tensor:
    """`Ops.moe_experts`: x [T, H], weights and expert_ids [T, K], gate_up [E, 2I, H] (gate rows, then
    up rows) and down [E, H, I] in x's dtype (the layer's experts from `first_expert` on), each
    weight's last axis contiguous -> [T, H] in x's dtype. `tiles` None picks them for the shape and
    device."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_experts, _, _ = gate_up.shape
    intermediate = down.shape[2]
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype}; the experts' weights are {gate_up.dtype} and {down.dtype}")
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("the experts' weights need their last axis contiguous")
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    picks = tokens * top_k
    tiles = tiles or choose_tiles(picks, num_experts, x.dtype)
    flat_ids = expert_ids.to(torch.int32).reshape(-1).contiguous()
    if first_expert:
        flat_ids = flat_ids - first_expert  # indices into the experts held
    pick_weights = weights.to(torch.float32).reshape(-1).contiguous()
    sorted_picks = sort_picks(flat_ids, num_experts, tiles.block_m)

    dot = _dot_settings(x.dtype)
    activation = torch.empty(sorted_picks.rows.shape[0], intermediate, dtype=x.dtype, device=x.device)
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **dot,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(x.device))
    _gate_up_kernel[(sorted_picks.tiles, triton.cdiv(intermediate, tiles.block_n))](
        x, gate_up, sorted_picks.rows, sorted_picks.tile_experts, sorted_picks.tile_rows, activation,
        hidden, intermediate, x.stride(0), gate_up.stride(0), gate_up.stride(1), activation.stride(0),
        top_k, EVEN_K=hidden % tiles.block_k == 0, **launch,
    )  # fmt: skip
    per_pick = torch.empty(picks, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(sorted_picks.tiles, triton.cdiv(hidden, tiles.block_n))](
        activation, down, pick_weights, sorted_picks.rows, sorted_picks.tile_experts, sorted_picks.tile_rows,
        per_pick, hidden, intermediate, activation.stride(0), down.stride(0), down.stride(1), per_pick.stride(0),
        EVEN_K=intermediate % tiles.block_k == 0, **launch,
    )  # fmt: skip
    block = min(triton.next_power_of_2(hidden), SUM_BLOCK)
    _sum_picks_kernel[(tokens, triton.cdiv(hidden, block))](
        per_pick, flat_ids, out, hidden, num_experts, per_pick.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
        **launch_options(x.device),
    )  # fmt: skip
    return out


def _dot_settings(dtype: torch.dtype) -> dict:
    """The dots' operand dtype and precision: x's dtype; float32 asks for exact products (tf32, Triton's
    default, applies to float32 alone). Triton 3.6's interpreter multiplies bfloat16's bits as integers
    (its create_dot), so there bfloat16 operands are widened to float32 first: exact either way, as a
    bfloat16 product is exact in float32 and the tensor cores accumulate in float32."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting()):
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, "DOT_PRECISION": "tf32"}


# Sorting. The pick count and everything sized by it are loop bounds and masks only.

@triton.jit(do_not_specialize=["picks"])
def _count_picks_kernel(expert_ids_ptr, chunk_counts_ptr, picks, num_experts,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, CHUNK, SUB):
        offsets = chunk * CHUNK + start + tl.arange(0, SUB)
        ids = tl.load(expert_ids_ptr + offsets, mask=offsets < picks, other=-1)
        counts += tl.sum(_one_hot(ids, experts, num_experts), axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + experts, counts)


# The tile's rows are arithmetic only: one build serves every tiling.
@triton.jit(do_not_specialize=["picks", "chunks", "tiles", "tiles_per_program", "block_m"])
def _place_picks_kernel(expert_ids_ptr, chunk_counts_ptr, rows_ptr, tile_experts_ptr, tile_rows_ptr,
                        picks, num_experts, chunks, tiles, tiles_per_program, block_m,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's picks in the chunks before this one
    for other in range(chunks):
        counted = tl.load(chunk_counts_ptr + other * BLOCK_E + experts)
        counts += counted
        before += tl.where(other < chunk, counted, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    # this chunk's picks, each to the next row of its expert, in pick order
    next_row = starts + before
    for start in range(0, CHUNK, SUB):
        offsets = chunk * CHUNK + start + tl.arange(0, SUB)
        ids = tl.load(expert_ids_ptr + offsets, mask=offsets < picks, other=-1)
        one_hot = _one_hot(ids, experts, num_experts)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # picks of the same expert before it in this block
        row = tl.sum(one_hot * (next_row[None, :] + earlier), axis=1)
        tl.store(rows_ptr + row, offsets, mask=tl.sum(one_hot, axis=1) > 0)
        next_row += tl.sum(one_hot, axis=0)

    # this program's share of the tiles: each one's expert and rows in use
    used_tiles = tl.sum(padded, axis=0) // block_m
    tile_ends = ends // block_m
    picks_end = starts + counts
    first = chunk * tiles_per_program
    last = tl.minimum(first + tiles_per_program, tiles)
    for block in range(first, last, SUB):
        tile = block + tl.arange(0, SUB)
        # the experts whose tiles all end at or before this one come before its expert
        expert = tl.sum((tile_ends[None, :] <= tile[:, None]).to(tl.int32), axis=1)
        ends_here = tl.sum(tl.where(experts[None, :] == expert[:, None], picks_end[None, :], 0), axis=1)
        in_use = tile < used_tiles
        rows_used = tl.minimum(tl.maximum(ends_here - tile * block_m, 0), block_m)
        tl.store(tile_experts_ptr + tile, tl.where(in_use, expert, -1), mask=tile < last)
        tl.store(tile_rows_ptr + tile, tl.where(in_use, rows_used, 0), mask=tile < last)


@triton.jit
def _one_hot(ids, experts, num_experts):
    """int32 [picks, experts]: 1 where a pick chose the expert; none for an id outside [0, E)."""
    return ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)


# The grouped GEMMs. A program is one tile (axis 0, so that consecutive programs are consecutive
# tiles of an expert and find its weight block in L2) by one block of output columns (axis 1).

@triton.jit
def _tile_rows(rows_ptr, tile_experts_ptr, tile_rows_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its expert (-1 past the last used tile), its rows, which of them hold
    picks, and those picks."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = tl.arange(0, BLOCK_M) < tl.load(tile_rows_ptr + tile)
    pick = tl.load(rows_ptr + rows, mask=row_valid, other=0)
    return expert, rows, row_valid, pick


@triton.jit
def _gate_up_kernel(x_ptr, gate_up_ptr, rows_ptr, tile_experts_ptr, tile_rows_ptr, activation_ptr,
                    hidden, intermediate, x_row_stride, expert_stride, weight_row_stride, activation_row_stride,
                    top_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    expert, rows, row_valid, pick = _tile_rows(rows_ptr, tile_experts_ptr, tile_rows_ptr, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pick // top_k).to(tl.int64)[:, None] * x_row_stride + ks[None, :]
    expert_rows = gate_up_ptr + expert.to(tl.int64) * expert_stride + ks[:, None]
    gate_rows = expert_rows + cols[None, :].to(tl.int64) * weight_row_stride
    up_rows = expert_rows + (intermediate + cols[None, :]).to(tl.int64) * weight_row_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        x_mask = row_valid[:, None]
        weight_mask = col_valid[None, :]
        if not EVEN_K:
            x_mask = x_mask & (k + ks[None, :] < hidden)
            weight_mask = weight_mask & (k + ks[:, None] < hidden)
        x = tl.load(x_rows + k, mask=x_mask, other=0.0).to(DOT_DTYPE)
        gate = tl.dot(x, tl.load(gate_rows + k, mask=weight_mask, other=0.0).to(DOT_DTYPE), gate,
                      input_precision=DOT_PRECISION)
        up = tl.dot(x, tl.load(up_rows + k, mask=weight_mask, other=0.0).to(DOT_DTYPE), up,
                    input_precision=DOT_PRECISION)
    activation = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(activation_ptr + rows.to(tl.int64)[:, None] * activation_row_stride + cols[None, :],
             activation.to(activation_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_kernel(activation_ptr, down_ptr, pick_weights_ptr, rows_ptr, tile_experts_ptr, tile_rows_ptr, per_pick_ptr,
                 hidden, intermediate, activation_row_stride, expert_stride, weight_row_stride, per_pick_row_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    expert, rows, row_valid, pick = _tile_rows(rows_ptr, tile_experts_ptr, tile_rows_ptr, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    activation_rows = activation_ptr + rows.to(tl.int64)[:, None] * activation_row_stride + ks[None, :]
    down_rows = (down_ptr + expert.to(tl.int64) * expert_stride + cols[None, :].to(tl.int64) * weight_row_stride
                 + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, intermediate, BLOCK_K):
        activation_mask = row_valid[:, None]
        weight_mask = col_valid[None, :]
        if not EVEN_K:
            activation_mask = activation_mask & (k + ks[None, :] < intermediate)
            weight_mask = weight_mask & (k + ks[:, None] < intermediate)
        activation = tl.load(activation_rows + k, mask=activation_mask, other=0.0).to(DOT_DTYPE)
        acc = tl.dot(activation, tl.load(down_rows + k, mask=weight_mask, other=0.0).to(DOT_DTYPE), acc,
                     input_precision=DOT_PRECISION)
    routing = tl.load(pick_weights_ptr + pick, mask=row_valid, other=0.0)
    tl.store(per_pick_ptr + pick.to(tl.int64)[:, None] * per_pick_row_stride + cols[None, :], acc * routing[:, None],
             mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _sum_picks_kernel(per_pick_ptr, expert_ids_ptr, out_ptr, hidden, num_experts, per_pick_row_stride, out_row_stride,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_valid = cols < hidden
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = token * TOP_K + j
        expert = tl.load(expert_ids_ptr + pick)
        chosen = (expert >= 0) & (expert < num_experts)
        total += tl.load(per_pick_ptr + pick * per_pick_row_stride + cols, mask=col_valid & chosen, other=0.0)
    tl.store(out_ptr + token * out_row_stride + cols, total.to(out_ptr.dtype.element_ty), mask=col_valid)
