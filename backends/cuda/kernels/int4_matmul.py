"""x @ W.T for W stored as int4 groups along K, each with a scale and a zero, in one Triton launch.

The weight's nibbles are packed two to a byte as uint8 [N, K / 2], each output's K contiguous (see
`pack_nibbles`), in runs of 32; the scales and zeros as [N, K / G], a group G of one to eight runs (32
for GGUF, GPTQ's and AWQ's 64 to 256 as their checkpoints keep them). In the tensor-core kernel a nibble becomes q - 8
with two bit operations and a subtraction, no integer-to-float conversion: ORed into the mantissa of a
float with the right exponent it is that float plus q (1024 + q in float16, 128 + q in bfloat16,
8388608 + q in float32), and subtracting the float plus 8 leaves q - 8 exactly. Each group's dot with the
raw q - 8 then takes its scale and zero:

    sum_k x[k] w[k] = scale * sum_k x[k] (q[k] - 8) + zero * sum_k x[k]

One row (a batch-1 decode) is a GEMV on the FMA units (`_int4_gemv_kernel`), where what bounds the time
can be the instructions a weight as much as the bytes: in the time its HBM delivers a weight (0.625
bytes with its group's scale and zero), an H200 issues about four instructions a thread, an H100 six.
It reads the nibbles as uint32 words, each thread a group's 16 bytes of one output a load, and turns a
nibble into a float with one shift and one LOP3: moved to the top of 1.0f's mantissa, it reads
1 + q / 16. The dot of a group then takes the constant part off once per group:

    sum_k x[k] (q[k] - 8) = 16 * sum_k x[k] (1 + q[k] / 16) - 24 * sum_k x[k]

so a weight costs a shift, a LOP3 and an FMA (4.3 instructions a weight in all on sm_90a, where the
byte-at-a-time form took eight: compile_check counts them). A thread keeps several outputs at the same
group, so the x values it converts serve them all, and it can load the next step's words before it
multiplies this step's. On the tensor cores a dot needs 16 rows, 15 of them zeros for a decode, and its
operands pass through shared memory: measured on an H200 at Llama-3-8B's shapes with the weight laid
out [K / 2, N], no tiling of that kernel streamed more than 19% of the copy bandwidth at one row
(bench/cuda_int4_tiles.py).

More rows (`_int4_matmul_kernel`): tiles dequantize w = (q - 8) * scale + zero in registers and take one
dot a step. The kernel can also dot the raw q - 8 per group of 32 and apply scale and zero to each
group's dot (SCALE_AFTER_DOT), which float32 x (its small tiles, not a serving path) still does; in 16-bit
it issues about twice the instructions a weight (choose_config).

Decodes split K across programs so that enough of them stream the int4 bytes at once; the last program
of an output tile to finish adds the splits' float32 partial sums, in split order, and writes the tile:
one launch in all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.availability import gpu_name, interpreting, multiprocessor_count
from candelabra.backends.cuda.kernels.activations import GATED_KINDS, NO_GATE
from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options, start_dependents, wait_for_prior
from candelabra.backends.cuda.kernels.gemv_tilings import GemvTiling, measured_tilings
from candelabra.backends.cuda.kernels.norms import RowNorm, normed_input
from candelabra.backends.cuda.kernels.split_k import (
    MAX_SPLIT_K,
    arrival_counts,
    finish_gemv_row,
    finish_tile,
    paired_rows,
    partial_squares,
    partial_sums,
    splits_for,
    splittable,
    steps_a_split,
)

GROUP_SIZE = 32  # values along K a packing run covers; a scale and zero may cover several runs
# The values a scale and zero cover (GROUP_SIZE times a power of two): GGUF's 32, GPTQ's and AWQ's 64 to
# 256 as their checkpoints keep them, so that a group of 128 stores 4.25 bits a weight, not 5.
SCALE_GROUPS = (32, 64, 128, 256)
# Byte row h of a group's 16 holds the group's value h in its low nibble and value h + 16 in its
# high nibble (GGUF's own order within a Q4_0 block), so a group's low and high nibbles are each a
# plain [16, BLOCK_N] operand and need no interleaving in registers.
HALF_GROUP = GROUP_SIZE // 2
# Per dtype of x: the bits of the float whose mantissa a nibble is ORed into (as the unsigned integer of
# the dtype's width), and that float plus 8.
MAGIC = {torch.float16: (0x6400, 1032.0), torch.bfloat16: (0x4300, 136.0), torch.float32: (0x4B000000, 8388616.0)}
_BITS = {torch.float16: tl.uint16, torch.bfloat16: tl.uint16, torch.float32: tl.uint32}


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: a program computes [block_m, block_n] of the output over a 1 / split_k
    share of K, block_k values of K per step (a multiple of 32). block_m 1 is the GEMV kernel (a row per
    program, on the FMA units); 16 and up the tensor-core kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    scale_after_dot: bool = True  # per group of 32: dot with q - 8, then scale and zero; else dequantize first
    # num_stages: Triton's pipelining depth for the tensor-core kernel. Triton does not pipeline the GEMV's
    # loop (no dot reads its loads): there, 2 or more loads the next step's weight before this step's math.

    @classmethod
    def of_gemv(cls, tiling: GemvTiling) -> TileConfig:
        """The GEMV launch a measured table's tiling describes."""
        return cls(block_m=1, block_n=tiling.block_n, block_k=tiling.block_k, split_k=tiling.split_k,
                   num_warps=tiling.num_warps, num_stages=tiling.num_stages)

    def gemv_tiling(self) -> GemvTiling:
        """This GEMV launch (block_m 1) as a measured table keeps it."""
        return GemvTiling(self.block_n, self.block_k, self.split_k, self.num_warps, self.num_stages)


# Under the interpreter every program runs in numpy, so few, large tiles keep tests fast; block_n
# 64 still leaves test widths that are not whole tiles.
INTERPRETER_CONFIG = TileConfig(block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=1,
                                scale_after_dot=False)
INTERPRETER_GEMV_CONFIG = TileConfig(block_m=1, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=1)
# Rows up to which each row is a GEMV of its own: past one, each reads the weight again (from L2 at best).
GEMV_ROWS = 1
# A GEMV program's step where the GPU has no measured table (gemv_tilings): [block_n, block_k / 2] bytes,
# 128 a thread at 2 warps (a group of 8 outputs), not loaded ahead, K split for 8 programs an SM. Of the
# tilings bench/cuda_int4_tiles.py timed on an H200, the one tiling for every shape of Llama-3-8B whose
# step's int4 GEMMs took least but 1% (2.38 ms; the one before this, loading ahead at 4 programs an SM,
# 2.65; each shape's own best, its table, 2.22). Its loop issues 4.0 instructions a weight on sm_90a.
GEMV_CONFIG = TileConfig(block_m=1, block_n=32, block_k=512, num_warps=2, num_stages=1)
GEMV_PROGRAMS_PER_SM = 8
# Rows up to which a batch is a decode: time goes to reading the int4 bytes, not to the dots.
DECODE_ROWS = 64
# Split K until there are about this many programs per SM: a decode's few output tiles alone
# would leave most of a Hopper's SMs idle, and one program cannot keep its SM's loads in flight.
PROGRAMS_PER_SM = 2


# The rows and each split's steps are loop bounds and masks only: one kernel for every batch and K.
@triton.jit(do_not_specialize=["M", "steps_per_split", "steps"])
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    arrivals_ptr,
    M,
    N,
    steps_per_split,
    steps,
    x_row_stride,
    packed_row_stride,
    scale_row_stride,
    out_row_stride,
    partials_split_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    MAGIC_PLUS_8: tl.constexpr,
    BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RUNS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    begin(DEPENDENT)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the column tiles together, so each weight tile is read from HBM once
    # per group rather than once per row tile, and found in L2 by the rest.
    tiles_per_group = GROUP_M * tiles_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % tiles_per_group) % group_rows
    tile_n = (tile % tiles_per_group) // group_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    weight_mask = col_mask[None, :]

    GROUPS: tl.constexpr = BLOCK_K // 32
    x_rows = x_ptr + rows[:, None] * x_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * steps_per_split * BLOCK_K
    steps_here = tl.minimum(steps_per_split, steps - split * steps_per_split)  # the last split's may be fewer
    if SCALE_AFTER_DOT:
        byte_rows = tl.arange(0, 16)
        for step in range(steps_here):
            for group in tl.static_range(GROUPS):
                k = k_start + step * BLOCK_K + group * 32
                packed = tl.load(packed_ptr + cols[None, :] * packed_row_stride + (k // 2 + byte_rows)[:, None],
                                 mask=weight_mask, other=0).to(BITS)
                x_low = tl.load(x_rows + (k + byte_rows)[None, :], mask=row_mask[:, None], other=0.0)
                x_high = tl.load(x_rows + (k + 16 + byte_rows)[None, :], mask=row_mask[:, None], other=0.0)
                low = ((packed & 0xF) | MAGIC_BITS).to(x_low.dtype, bitcast=True) - MAGIC_PLUS_8
                high = ((packed >> 4) | MAGIC_BITS).to(x_low.dtype, bitcast=True) - MAGIC_PLUS_8
                dot = tl.dot(x_low, low.to(x_low.dtype), input_precision=DOT_PRECISION)
                dot = tl.dot(x_high, high.to(x_low.dtype), dot, input_precision=DOT_PRECISION)
                x_sum = tl.sum(x_low.to(tl.float32), axis=1) + tl.sum(x_high.to(tl.float32), axis=1)
                group_offsets = cols * scale_row_stride + k // (32 * RUNS)
                scale = tl.load(scales_ptr + group_offsets, mask=col_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + group_offsets, mask=col_mask, other=0.0).to(tl.float32)
                acc += dot * scale[None, :] + x_sum[:, None] * zero[None, :]
    else:
        HALF_K: tl.constexpr = BLOCK_K // 2
        byte_rows = tl.arange(0, HALF_K)
        # K offset, within a step, of the value in each byte row's low nibble; its high nibble's is 16 on.
        low_k = (byte_rows // 16) * 32 + byte_rows % 16
        groups = tl.arange(0, GROUPS)
        for step in range(steps_here):
            k = k_start + step * BLOCK_K
            packed = tl.load(packed_ptr + cols[None, :] * packed_row_stride + (k // 2 + byte_rows)[:, None],
                             mask=weight_mask, other=0).to(BITS)
            # one scale and zero per run of 32, loaded once and repeated over its 16 byte rows in registers
            group_offsets = cols[None, :] * scale_row_stride + ((k // 32 + groups) // RUNS)[:, None]
            scale = _repeat_rows(tl.load(scales_ptr + group_offsets, mask=weight_mask, other=0.0), GROUPS, 16, BLOCK_N)
            zero = _repeat_rows(tl.load(zeros_ptr + group_offsets, mask=weight_mask, other=0.0), GROUPS, 16, BLOCK_N)
            x_low = tl.load(x_rows + (k + low_k)[None, :], mask=row_mask[:, None], other=0.0)
            x_high = tl.load(x_rows + (k + 16 + low_k)[None, :], mask=row_mask[:, None], other=0.0)
            low = (((packed & 0xF) | MAGIC_BITS).to(x_low.dtype, bitcast=True) - MAGIC_PLUS_8) * scale + zero
            high = (((packed >> 4) | MAGIC_BITS).to(x_low.dtype, bitcast=True) - MAGIC_PLUS_8) * scale + zero
            acc = tl.dot(x_low, low.to(x_low.dtype), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_high, high.to(x_high.dtype), acc, input_precision=DOT_PRECISION)

    finish_tile(acc, out_ptr, bias_ptr, partials_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask, N,
                out_row_stride, partials_split_stride, SPLIT, HAS_BIAS, 0.0, partials_ptr, 1, 0.0, False)


# A nibble q ORed into the top four bits of 1.0f's mantissa (bits 19 to 22) makes the float 1 + q / 16.
# Passed to the GEMV as an argument: as an immediate, ptxas spends a second LOP3 a nibble on the OR.
ONE_BITS = 0x3F800000


@triton.jit
def _nibble_floats(words, SHIFT: tl.constexpr, one_bits):
    """1 + q / 16 in float32 for the nibble q at bits SHIFT to SHIFT + 3 of each uint32 word: one shift
    and one LOP3 a weight."""
    if SHIFT <= 19:
        moved = words << (19 - SHIFT)
    else:
        moved = words >> (SHIFT - 19)
    return ((moved & 0x780000) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _step_weight(words_ptr, scales_ptr, zeros_ptr, k, word_offsets, group_offsets, col_mask, held,
                 RUNS: tl.constexpr):
    """The GEMV's step at K offset k: its uint32 words [GROUPS, BLOCK_N, 4] and each run's scale and zero
    [GROUPS, BLOCK_N]; zeros where `held` is false or past the last column."""
    words = tl.load(words_ptr + k // 8 + word_offsets, mask=col_mask[None, :, None] & held, other=0)
    scale = tl.load(scales_ptr + k // (32 * RUNS) + group_offsets, mask=col_mask[None, :] & held, other=0.0)
    zero = tl.load(zeros_ptr + k // (32 * RUNS) + group_offsets, mask=col_mask[None, :] & held, other=0.0)
    return words, scale, zero


@triton.jit
def _quarters(values, GROUPS: tl.constexpr):
    """[GROUPS, 4, 4] values to the four [GROUPS, 4] slices along the last axis, in order."""
    pairs = tl.reshape(values, (GROUPS, 4, 2, 2))
    even, odd = tl.split(pairs)
    first, third = tl.split(even)
    second, fourth = tl.split(odd)
    return first, second, third, fourth


# K is a loop bound only; the grid's third axis is the row.
@triton.jit(do_not_specialize=["steps_per_split", "steps"])
def _int4_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    arrivals_ptr,
    squares_ptr,
    residual_ptr,
    norm_weight_ptr,
    joined_ptr,
    eps,
    norm_offset,
    N,
    steps_per_split,
    steps,
    x_row_stride,
    packed_row_stride,
    scale_row_stride,
    out_row_stride,
    partials_split_stride,
    one_bits,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    RUNS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATE_OUT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    start_dependents(DEPENDENT)
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    GROUPS: tl.constexpr = BLOCK_K // 32
    cols, col_mask = paired_rows(tile_n, BLOCK_N, N, GATE_OUT)
    groups = tl.arange(0, GROUPS)
    quads = tl.arange(0, 4)
    # A step is [GROUPS, BLOCK_N, 4] uint32 words: a group's 16 bytes of one output in one thread, whose
    # other outputs (groups lead the layout) are at the same group, so the x it converts serves them all.
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32))
    word_offsets = groups[:, None, None] * 4 + cols[None, :, None] * (packed_row_stride // 4) + quads[None, None, :]
    # a run's scale group (a step starts one: BLOCK_K is a multiple of 32 * RUNS)
    group_offsets = (groups // RUNS)[:, None] + cols[None, :] * scale_row_stride
    # K offsets of the low nibbles of word w's four bytes, 4w to 4w + 3 in the group; the high ones' are 16 on
    x_offsets = groups[:, None, None] * 32 + quads[None, :, None] * 4 + quads[None, None, :]
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * x_row_stride
    joined_row = joined_ptr + row * x_row_stride
    acc = tl.zeros((GROUPS, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((GROUPS, 4, 4), dtype=tl.float32)  # of a normalised x, over this program's share of K
    k = split * steps_per_split * BLOCK_K
    steps_here = tl.minimum(steps_per_split, steps - split * steps_per_split)  # the last split's may be fewer
    words, scale, zero = _step_weight(words_ptr, scales_ptr, zeros_ptr, k, word_offsets, group_offsets, col_mask,
                                      steps_here > 0, RUNS)
    wait_for_prior(DEPENDENT)  # the first step's weight is on its way meanwhile
    for step in range(steps_here):
        more = step + 1 < steps_here
        if PREFETCH:  # the next step's weight is on its way while this one's is multiplied
            next_words, next_scale, next_zero = _step_weight(words_ptr, scales_ptr, zeros_ptr, k + BLOCK_K,
                                                             word_offsets, group_offsets, col_mask, more, RUNS)
        if NORM:  # x times the norm's weight, its 1 / rms applied to the finished sums (they are linear in x)
            x_low, s_low = normed_input(x_row, residual_row, norm_weight_ptr, joined_row, k + x_offsets, norm_offset,
                                        tile_n == 0, RESIDUAL)
            x_high, s_high = normed_input(x_row, residual_row, norm_weight_ptr, joined_row, k + 16 + x_offsets,
                                          norm_offset, tile_n == 0, RESIDUAL)
            squares += s_low * s_low + s_high * s_high
        else:
            x_low = tl.load(x_row + k + x_offsets).to(tl.float32)
            x_high = tl.load(x_row + k + 16 + x_offsets).to(tl.float32)
        low0, low1, low2, low3 = _quarters(x_low, GROUPS)
        high0, high1, high2, high3 = _quarters(x_high, GROUPS)
        # byte j of a word holds value 4w + j in bits 8j to 8j + 3 and value 16 + 4w + j above them
        dots = _nibble_floats(words, 0, one_bits) * low0[:, None, :]
        dots += _nibble_floats(words, 4, one_bits) * high0[:, None, :]
        dots += _nibble_floats(words, 8, one_bits) * low1[:, None, :]
        dots += _nibble_floats(words, 12, one_bits) * high1[:, None, :]
        dots += _nibble_floats(words, 16, one_bits) * low2[:, None, :]
        dots += _nibble_floats(words, 20, one_bits) * high2[:, None, :]
        dots += _nibble_floats(words, 24, one_bits) * low3[:, None, :]
        dots += _nibble_floats(words, 28, one_bits) * high3[:, None, :]
        x_sums = tl.sum(tl.sum(x_low + x_high, axis=2), axis=1)
        # sum x (1 + q / 16) = sum x + sum x q / 16, so sum x (q - 8) = 16 * that - 24 * sum x
        scale, zero = scale.to(tl.float32), zero.to(tl.float32)
        acc += tl.sum(dots, axis=2) * (16.0 * scale) + x_sums[:, None] * (zero - 24.0 * scale)
        k += BLOCK_K
        if PREFETCH:
            words, scale, zero = next_words, next_scale, next_zero
        else:
            words, scale, zero = _step_weight(words_ptr, scales_ptr, zeros_ptr, k, word_offsets, group_offsets,
                                              col_mask, more, RUNS)
    row_squares = tl.sum(tl.sum(tl.sum(squares, axis=2), axis=1), axis=0)
    finish_gemv_row(tl.sum(acc, axis=0), out_ptr, bias_ptr, partials_ptr, arrivals_ptr, row, tile_n, split, cols,
                    col_mask, N, out_row_stride, partials_split_stride, SPLIT, HAS_BIAS, row_squares, squares_ptr,
                    steps * BLOCK_K, eps, NORM, GATE_OUT)


@triton.jit
def _repeat_rows(values, ROWS: tl.constexpr, TIMES: tl.constexpr, COLUMNS: tl.constexpr):
    """[ROWS, COLUMNS] to [ROWS * TIMES, COLUMNS], each row repeated TIMES times in a row."""
    repeated = tl.broadcast_to(values[:, None, :], (ROWS, TIMES, COLUMNS))
    return tl.reshape(repeated, (ROWS * TIMES, COLUMNS))


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """uint8 [N, K] values 0..15 (K a multiple of 32) to the kernels' uint8 [N, K / 2]: in each group of
    32 along K, byte h of the group's 16 holds value h in its low nibble and value h + 16 in its high one."""
    rows, columns = nibbles.shape
    if columns % GROUP_SIZE:
        raise ValueError(f"int4 groups are {GROUP_SIZE} values along K; {columns} columns are not whole groups")
    halves = nibbles.reshape(rows, columns // GROUP_SIZE, 2, HALF_GROUP)
    pairs = halves[:, :, 0, :] | (halves[:, :, 1, :] << 4)
    return np.ascontiguousarray(pairs.reshape(rows, columns // 2))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                config: TileConfig | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ W.T (+ bias [N]) -> [M, N] in x's dtype, W given by `packed` uint8
    [N, K / 2] (`pack_nibbles`) and `scales`, `zeros` [N, K / G] with W[n, k] = (q - 8) * scale + zero for
    the nibble q of (n, k) and its group's scale and zero, G one of SCALE_GROUPS. `config` None picks one
    for the shape and device; a config's block_k must be a multiple of G."""
    return _int4_product(x, packed, scales, zeros, config, bias, None, None)[0]


def normed_int4_gemv(x: torch.Tensor, norm: RowNorm, packed: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, config: TileConfig | None = None, bias: torch.Tensor | None = None,
                     gate_output: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`Ops.rms_norm_linear` by the GEMV, for rows of x few enough for it (GEMV_ROWS): as `int4_matmul`
    multiplies, of the rows normalised as it loads them, and the row plus residual (x itself without one).
    With `gate_output` (an `Ops.gated_linear` activation) the weight's 2I rows are a gated MLP's gate and up,
    and the product [M, I] their gated values (as dense_gemv.normed_dense_gemv gives them)."""
    norm.check(x)
    if x.shape[0] > GEMV_ROWS or (config is not None and config.block_m != 1):
        raise ValueError(f"the int4 GEMV normalises x as it loads it; {x.shape[0]} rows (or a config of "
                         f"{config.block_m if config else '?'}) take the tensor-core GEMM, which does not")
    return _int4_product(x.contiguous(), packed, scales, zeros, config, bias, norm, gate_output)


def _int4_product(x, packed, scales, zeros, config, bias, norm, gate_output):
    rows, width = x.shape
    columns = packed.shape[0]
    group = width // scales.shape[1] if scales.ndim == 2 and scales.shape[1] else 0
    if (packed.shape[1] * 2 != width or group not in SCALE_GROUPS or scales.shape != (columns, width // group)
            or zeros.shape != scales.shape or not all(tensor.is_contiguous() for tensor in (packed, scales, zeros))):
        raise ValueError(f"x [{rows}, {width}] does not match an int4 weight of contiguous packed "
                         f"{list(packed.shape)}, scales {list(scales.shape)} and zeros {list(zeros.shape)} "
                         f"(a scale covers one of {', '.join(map(str, SCALE_GROUPS))} values along K)")
    if bias is not None and (bias.shape != (columns,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous [{columns}], not {list(bias.shape)}")
    if packed.data_ptr() % 4:
        raise ValueError("the packed int4 weight must start at a multiple of 4 bytes: the GEMV reads it as "
                         "uint32 words")
    if x.stride(-1) != 1:
        x = x.contiguous()
    config = config or choose_config(rows, columns, width, x.device, x.dtype, group)
    if gate_output is not None and (gate_output not in GATED_KINDS or columns % 2 or config.block_m != 1):
        raise ValueError(f"a gated output ({gate_output!r}, one of {tuple(GATED_KINDS)}) takes the GEMV (not a "
                         f"config of {config.block_m} rows) and a weight of an even number of rows, gate then up "
                         f"({columns})")
    out = torch.empty(rows, columns if gate_output is None else columns // 2, dtype=x.dtype, device=x.device)
    joined = x if norm is None else norm.joined_like(x)
    if rows == 0 or columns == 0:
        return out, joined
    if width == 0:
        return (out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()), joined
    if width % config.block_k:
        raise ValueError(f"block_k {config.block_k} does not divide K = {width}")
    if config.block_m == 1 and config.block_k % group:
        raise ValueError(f"the GEMV's block_k {config.block_k} must be a multiple of the scales' group of {group}")
    steps = width // config.block_k
    # each split takes a step at least (the last may take fewer than the others)
    split_k = max(split for split in range(1, min(config.split_k, steps) + 1) if splittable(steps, split))
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(columns, config.block_n)
    partials = partial_sums(out, split_k, columns)
    squares = partial_squares(out, split_k, tiles, norm is not None)
    arrivals = arrival_counts(x.device, tiles if split_k > 1 else 1)
    strides = (x.stride(0), packed.stride(0), scales.stride(0), out.stride(0), rows * columns)
    if config.block_m == 1:
        _int4_gemv_kernel[(triton.cdiv(columns, config.block_n), split_k, rows)](
            x, packed, scales, zeros, out if bias is None else bias, out, partials, arrivals, squares,
            *(RowNorm.absent(x) if norm is None else norm.kernel_arguments(x, joined)), columns,
            steps_a_split(steps, split_k), steps, *strides, ONE_BITS, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, SPLIT=split_k > 1,
            PREFETCH=config.num_stages > 1, RUNS=group // GROUP_SIZE, HAS_BIAS=bias is not None,
            NORM=norm is not None, RESIDUAL=norm is not None and norm.residual is not None,
            GATE_OUT=NO_GATE.value if gate_output is None else GATED_KINDS[gate_output],
            num_warps=config.num_warps, num_stages=1, **launch_options(x.device),
        )  # fmt: skip
        return out, joined
    magic_bits, magic_plus_8 = MAGIC[x.dtype]
    _int4_matmul_kernel[(tiles, split_k)](
        x, packed, scales, zeros, out if bias is None else bias, out, partials, arrivals,
        rows, columns, steps_a_split(steps, split_k), steps, *strides,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        SPLIT=split_k > 1,
        SCALE_AFTER_DOT=config.scale_after_dot,
        MAGIC_BITS=magic_bits,
        MAGIC_PLUS_8=magic_plus_8,
        BITS=_BITS[x.dtype],
        # tf32 is Triton's default and applies to float32 operands alone: float32 asks for exact products
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        RUNS=group // GROUP_SIZE,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(x.device),
    )  # fmt: skip
    return out, joined


def choose_config(rows: int, columns: int, width: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, group: int = GROUP_SIZE) -> TileConfig:
    """The tiling for an [rows, width] @ [width, columns] product of x in `dtype` on `device` (a fixed one
    under the interpreter). One row is a GEMV, tiled as the GPU model's measured table has it for this
    shape (gemv_tilings), else GEMV_CONFIG. Chosen for Hopper: other decode batches stream the int4
    bytes with narrow tiles and split K; larger batches take the usual GEMM tiles with more warps. float32
    x multiplies on the FMA units, whose operands take far more registers: tiles of at most 32 x 64. ptxas
    builds every tile here for sm_90a without spills (compile_check.SPILL_FREE holds it to that), and in
    16-bit for sm_80 too."""
    if interpreting():
        if rows <= GEMV_ROWS:
            return _fitted(INTERPRETER_GEMV_CONFIG, width, group)
        # the tiles' form is the one a GPU gets in this dtype
        return _fitted(replace(INTERPRETER_CONFIG, scale_after_dot=dtype == torch.float32), width)
    if rows <= GEMV_ROWS:
        name = gpu_name(device)
        measured = measured_tilings(name).get((columns, width)) if name else None
        if measured is not None and measured.block_k % group == 0:
            return TileConfig.of_gemv(measured)
        config = GEMV_CONFIG
    elif dtype == torch.float32:
        config = TileConfig(block_m=min(32, max(16, triton.next_power_of_2(rows))), block_n=64, block_k=64,
                            num_warps=4, num_stages=3)
    elif rows <= DECODE_ROWS:
        # small block_n gives a decode more programs to spread the weight's bytes over. Dequantized before
        # its dot: compiled for sm_90a at Llama-3-8B's shapes, a 16-row tile's loop issues 6.3 instructions
        # a weight that way against 13.7 dotting the raw q - 8 per group of 32 (two dots and a rescale a
        # group), 7.8 against 19.2 at 32 rows and 6.1 against 26.0 at 64.
        config = TileConfig(block_m=max(16, triton.next_power_of_2(rows)), block_n=64, block_k=128,
                            num_warps=4, num_stages=4, scale_after_dot=False)
    elif rows <= 256:
        config = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, scale_after_dot=False)
    else:
        config = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, scale_after_dot=False)
    programs_per_sm = GEMV_PROGRAMS_PER_SM if config.block_m == 1 else PROGRAMS_PER_SM
    # the float32 partial sums are written and read back: 8 bytes an output per split, which should stay
    # within half the weight's int4 bytes, N * K / 2
    return split_for_programs(config, rows, columns, width, programs_per_sm * multiprocessor_count(device), group,
                              most_splits=max(1, width // (32 * rows)))


def split_for_programs(config: TileConfig, rows: int, columns: int, width: int, programs: int,
                       group: int = GROUP_SIZE, most_splits: int = MAX_SPLIT_K) -> TileConfig:
    """`config` fitted to K (and to a scale group of `group`) with K split for about `programs` programs,
    in at most `most_splits`."""
    config = _fitted(config, width, group if config.block_m == 1 else GROUP_SIZE)
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(columns, config.block_n)
    return replace(config, split_k=splits_for(tiles, width // config.block_k, programs, most_splits))


def _fitted(config: TileConfig, width: int, group: int = GROUP_SIZE) -> TileConfig:
    """`config` with block_k halved until it divides K (a multiple of `group`, so `group` at worst), or
    raised to `group`: a GEMV step covers whole scale groups, a tile's step whole runs of 32."""
    block_k = max(config.block_k, group)
    while width % block_k and block_k > group:
        block_k //= 2
    return replace(config, block_k=block_k)
