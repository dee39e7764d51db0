"""x @ W.T for W stored as int4 groups of 32 along K, each with a scale and a zero, in one Triton GEMM.

The weight's nibbles are packed two to a byte as uint8 [K / 2, N] (see `pack_nibbles`); each
program loads packed tiles, dequantizes them in registers, w = (q - 8) * scale + zero in float32,
rounds w to x's dtype and accumulates with tl.dot in float32. Decode batches (few rows) split K
across programs so that enough of them stream the int4 bytes at once; their float32 partial sums
are added afterwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.availability import interpreting

GROUP_SIZE = 32
# Byte row h of a group's 16 holds the group's value h in its low nibble and value h + 16 in its
# high nibble (GGUF's own order within a Q4_0 block), so a tile's low and high nibbles are each a
# plain [BLOCK_K / 2, BLOCK_N] operand and need no interleaving in registers.
HALF_GROUP = GROUP_SIZE // 2


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: a program computes [block_m, block_n] of the output over a 1 / split_k
    share of K, block_k values of K per step (a multiple of 32)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Under the interpreter every program runs in numpy, so few, large tiles keep tests fast; block_n
# 64 still leaves test widths that are not whole tiles.
INTERPRETER_CONFIG = TileConfig(block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=1)
# Rows up to which a batch is a decode: time goes to reading the int4 bytes, not to the dots.
DECODE_ROWS = 64
# Split K until there are about this many programs per SM: a decode's few output tiles alone
# would leave most of a Hopper's SMs idle, and one program cannot keep its SM's loads in flight.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 16
# Each split's share of K, in steps: fewer and the partial sums cost more than they save.
MIN_STEPS_PER_SPLIT = 2


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    x_row_stride,
    out_row_stride,
    out_split_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STEPS_PER_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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

    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    byte_rows = tl.arange(0, HALF_K)
    # K offset, within a step, of the value in each byte row's low nibble; its high nibble's is 16 on.
    low_k = (byte_rows // 16) * 32 + byte_rows % 16
    groups = tl.arange(0, GROUPS)
    weight_mask = col_mask[None, :]

    x_rows = x_ptr + rows[:, None] * x_row_stride
    k_start = split * STEPS_PER_SPLIT * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A compile-time trip count: Triton's interpreter cannot loop to a runtime bound under numpy 2.4
    # (it takes int() of a one-element array), and a model has only a few K and split counts.
    for step in range(STEPS_PER_SPLIT):
        k = k_start + step * BLOCK_K
        packed = tl.load(packed_ptr + (k // 2 + byte_rows)[:, None] * N + cols[None, :], mask=weight_mask, other=0)
        # one scale and zero per group, loaded once and repeated over its 16 byte rows in registers
        group_offsets = (k // 32 + groups)[:, None] * N + cols[None, :]
        scale = _repeat_rows(tl.load(scales_ptr + group_offsets, mask=weight_mask, other=0.0).to(tl.float32),
                             GROUPS, 16, BLOCK_N)
        zero = _repeat_rows(tl.load(zeros_ptr + group_offsets, mask=weight_mask, other=0.0).to(tl.float32),
                            GROUPS, 16, BLOCK_N)
        low = ((packed & 0xF).to(tl.float32) - 8.0) * scale + zero
        high = ((packed >> 4).to(tl.float32) - 8.0) * scale + zero
        x_low = tl.load(x_rows + (k + low_k)[None, :], mask=row_mask[:, None], other=0.0)
        x_high = tl.load(x_rows + (k + 16 + low_k)[None, :], mask=row_mask[:, None], other=0.0)
        acc = tl.dot(x_low, low.to(x_low.dtype), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_high, high.to(x_high.dtype), acc, input_precision=DOT_PRECISION)

    out = out_ptr + split * out_split_stride + rows[:, None] * out_row_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _repeat_rows(values, ROWS: tl.constexpr, TIMES: tl.constexpr, COLUMNS: tl.constexpr):
    """[ROWS, COLUMNS] to [ROWS * TIMES, COLUMNS], each row repeated TIMES times in a row."""
    repeated = tl.broadcast_to(values[:, None, :], (ROWS, TIMES, COLUMNS))
    return tl.reshape(repeated, (ROWS * TIMES, COLUMNS))


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """uint8 [N, K] values 0..15 (K a multiple of 32) to the kernel's uint8 [K / 2, N]: in each group of
    32 along K, byte row h holds value h in its low nibble and value h + 16 in its high nibble."""
    rows, columns = nibbles.shape
    if columns % GROUP_SIZE:
        raise ValueError(f"int4 groups are {GROUP_SIZE} values along K; {columns} columns are not whole groups")
    halves = nibbles.reshape(rows, columns // GROUP_SIZE, 2, HALF_GROUP)
    pairs = halves[:, :, 0, :] | (halves[:, :, 1, :] << 4)
    return np.ascontiguousarray(pairs.reshape(rows, columns // 2).T)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ W.T -> [M, N] in x's dtype, W given by `packed` uint8 [K / 2, N]
    (`pack_nibbles`) and `scales`, `zeros` [K / 32, N] with W[n, k] = (q - 8) * scale + zero for the
    nibble q of (k, n) and its group's scale and zero. `config` None picks one for the shape and device."""
    rows, width = x.shape
    columns = packed.shape[1]
    if packed.shape[0] * 2 != width or scales.shape != (width // GROUP_SIZE, columns) or zeros.shape != scales.shape:
        raise ValueError(f"x [{rows}, {width}] does not match an int4 weight of packed {list(packed.shape)}, "
                         f"scales {list(scales.shape)} and zeros {list(zeros.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows == 0 or columns == 0:
        return out
    if width == 0:
        return out.zero_()
    config = config or choose_config(rows, columns, width, x.device)
    if width % config.block_k:
        raise ValueError(f"block_k {config.block_k} does not divide K = {width}")
    steps = width // config.block_k
    # every split takes the same number of steps: the kernel's loop then needs no bound of its own
    split_k = max(split for split in range(1, min(config.split_k, steps) + 1) if steps % split == 0)
    steps_per_split = steps // split_k
    partials = out if split_k == 1 else torch.empty(split_k, rows, columns, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(columns, config.block_n), split_k)
    _int4_matmul_kernel[grid](
        x, packed, scales, zeros, partials,
        rows, columns,
        x.stride(0), columns, rows * columns,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        STEPS_PER_SPLIT=steps_per_split,
        # tf32 is Triton's default and applies to float32 operands alone: float32 asks for exact products
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split_k == 1:
        return out
    return partials.sum(dim=0).to(x.dtype)


def choose_config(rows: int, columns: int, width: int, device: torch.device) -> TileConfig:
    """The tiling for an [rows, width] @ [width, columns] product on `device` (a fixed one under the
    interpreter). Chosen for Hopper: decode batches stream the int4 bytes with narrow tiles and split
    K; larger batches take the usual GEMM tiles with more warps."""
    if interpreting():
        return _fitted(INTERPRETER_CONFIG, width)
    if rows <= DECODE_ROWS:
        # small block_n gives a decode more programs to spread the weight's bytes over
        config = TileConfig(block_m=max(16, triton.next_power_of_2(rows)), block_n=64, block_k=128,
                            num_warps=4, num_stages=4)
    elif rows <= 256:
        config = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
        config = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    config = _fitted(config, width)
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(columns, config.block_n)
    # the float32 partial sums are written and read back: 8 bytes an output per split, which should stay
    # within half the weight's int4 bytes, N * K / 2
    most_splits = max(1, width // (32 * rows))
    return _with_split_k(config, tiles, width // config.block_k, most_splits, _sm_count(device))


def _fitted(config: TileConfig, width: int) -> TileConfig:
    """`config` with block_k halved until it divides K (a multiple of 32, so 32 at worst)."""
    block_k = config.block_k
    while width % block_k and block_k > GROUP_SIZE:
        block_k //= 2
    return replace(config, block_k=block_k)


def _with_split_k(config: TileConfig, tiles: int, steps: int, most_splits: int, sm_count: int) -> TileConfig:
    """`config` with the fewest splits of K (a divisor of its steps) that give PROGRAMS_PER_SM programs
    per SM, or as many as `most_splits`, MAX_SPLIT_K and MIN_STEPS_PER_SPLIT allow."""
    allowed = [split for split in range(1, min(most_splits, MAX_SPLIT_K) + 1)
               if steps % split == 0 and (split == 1 or steps // split >= MIN_STEPS_PER_SPLIT)]
    enough = [split for split in allowed if tiles * split >= PROGRAMS_PER_SM * sm_count]
    return replace(config, split_k=enough[0] if enough else allowed[-1])


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
