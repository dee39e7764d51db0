"""x @ W.T (+ bias) for one row of x and a float16 or bfloat16 weight W [N, K], on the FMA units, where
the GPU's measured table says it beats cuBLAS at that shape (`chosen_tiling`).

At one row a product reads each weight once and does one FMA with it: it is bound by HBM alone (an H200
delivers a 16-bit weight in the time it issues about fourteen instructions a thread), so what counts is
enough bytes in flight on every SM. cuBLAS streamed Llama-3-8B's larger weights at 92-99% of an H200's
copy bandwidth but its qkv and attention-output projections at 72-75%, with split-K reductions in kernels
of their own after them (bench/results/h200-2026-11-27). Here a program takes BLOCK_N outputs over a share
of K, BLOCK_K of it a step, each thread 16 bytes of one output's row a load; K is split across programs
for a few programs an SM, and the last split to finish a tile adds the partial sums and the bias
(kernels/split_k.py), one launch in all. Whether that wins depends on the GPU and the shape, so the
backend times it against cuBLAS over the model's own weights at start-up (backends/cuda/gemv_tuning.py)
and keeps whichever was faster in the GPU's dense table.

A gated MLP's down projection (`Ops.gated_linear`) takes the gate and up halves as its x and computes
the gated values as it loads them: the activation's kernel, its launch and its output's trip through
memory are gone, for twice the x loads (from L2: the gate and up row is the product before's output).
A pre-norm's projection (`Ops.rms_norm_linear`) likewise normalises x as it loads it: a program multiplies
each x (plus the residual it adds) by the norm's weight and sums its squares over its share of K; the 1 / rms
they give scales the finished sums (with K split, the last split to finish adds every split's squares:
kernels/split_k.py), and the first column tile's programs store the row plus residual the next layer adds
to. The norm's kernel and its launch are gone, and no program reads more of x than its share.
A gated MLP's gate and up projection after its norm (`Ops.rms_norm_gated_mlp`) may also write the gated
values: a program then takes its outputs in (gate, up) pairs, row j beside row j + I, and writes act(gate) * up
for each (split_k.paired_rows and store_tile), so the down projection after it is a plain product.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from candelabra.backends.cuda.availability import gpu_name
from candelabra.backends.cuda.kernels.activations import GATED_KINDS, NO_GATE, gated_input
from candelabra.backends.cuda.kernels.dependent_launch import launch_options, start_dependents, wait_for_prior
from candelabra.backends.cuda.kernels.gemv_tilings import GemvTiling, measured_tilings
from candelabra.backends.cuda.kernels.norms import RowNorm, normed_input
from candelabra.backends.cuda.kernels.split_k import (
    arrival_counts,
    finish_gemv_row,
    paired_rows,
    partial_squares,
    partial_sums,
    splittable,
    steps_a_split,
)

DTYPES = (torch.float16, torch.bfloat16)
# Weights a thread loads at once: 16 bytes of 16-bit values.
VECTOR = 8
# CANDELABRA_DENSE_GEMV=0 keeps every dense product with cuBLAS, whatever the tables say.
SWITCH = "CANDELABRA_DENSE_GEMV"
# The kernel's offsets into the weight are 32-bit: a larger matrix (a 256k vocabulary at a hidden size of
# 8,192) stays with cuBLAS.
MOST_ELEMENTS = 2**31 - 1


@triton.jit(do_not_specialize=["steps_per_split", "steps"])
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
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
    w_row_stride,
    out_row_stride,
    partials_split_stride,
    width,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VECTOR: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATE: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATE_OUT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    start_dependents(DEPENDENT)
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    CHUNKS: tl.constexpr = BLOCK_K // VECTOR
    cols, col_mask = paired_rows(tile_n, BLOCK_N, N, GATE_OUT)
    # A step is [CHUNKS, BLOCK_N, VECTOR]: a thread's VECTOR weights are contiguous along K, and the chunks
    # lead the layout, so a thread's other weights are other outputs' at the same chunk, which the x it
    # converts serves too (outputs leading, each thread would convert an x a weight). Its sums stay in the
    # thread until the last step.
    along_k = tl.arange(0, CHUNKS)[:, None] * VECTOR + tl.arange(0, VECTOR)[None, :]
    w_offsets = along_k[:, None, :] + cols[None, :, None] * w_row_stride
    w_mask = col_mask[None, :, None]
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * x_row_stride
    joined_row = joined_ptr + row * x_row_stride
    acc = tl.zeros((CHUNKS, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((CHUNKS, VECTOR), dtype=tl.float32)  # of a normalised x, over this program's share of K
    k = split * steps_per_split * BLOCK_K
    steps_here = tl.minimum(steps_per_split, steps - split * steps_per_split)  # the last split's may be fewer
    w = tl.load(w_ptr + k + w_offsets, mask=w_mask & (steps_here > 0), other=0.0)
    wait_for_prior(DEPENDENT)  # the first step's weight is on its way meanwhile
    for step in range(steps_here):
        more = step + 1 < steps_here
        if PREFETCH:  # the next step's weight is on its way while this one's is multiplied
            next_w = tl.load(w_ptr + k + BLOCK_K + w_offsets, mask=w_mask & more, other=0.0)
        if NORM:  # the first column tile's programs store x + residual for the next layer
            x, joined = normed_input(x_row, residual_row, norm_weight_ptr, joined_row, k + along_k, norm_offset,
                                     tile_n == 0, RESIDUAL)
            squares += joined * joined
        else:
            x = gated_input(x_row, k + along_k, width, GATE)
        acc += tl.sum(w.to(tl.float32) * x[:, None, :], axis=2)
        k += BLOCK_K
        if PREFETCH:
            w = next_w
        else:
            w = tl.load(w_ptr + k + w_offsets, mask=w_mask & more, other=0.0)
    finish_gemv_row(tl.sum(acc, axis=0), out_ptr, bias_ptr, partials_ptr, arrivals_ptr, row, tile_n, split, cols,
                    col_mask, N, out_row_stride, partials_split_stride, SPLIT, HAS_BIAS,
                    tl.sum(tl.sum(squares, axis=1), axis=0), squares_ptr, width, eps, NORM, GATE_OUT)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling,
               bias: torch.Tensor | None = None, gated: str | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias [N]) -> [M, N] in x's dtype, for a float16 or bfloat16 `weight` [N, K]
    with unit stride along K, tiled as `tiling` says (its block_k a divisor of K, split_k at most its steps,
    each split taking one at least: `steps_a_split`).
    With `gated` (an `Ops.gated_linear` activation), x is [M, 2K], a gated MLP's gate and up halves, and
    the product is `gated_linear`'s. Each row of x reads the whole weight: meant for one."""
    if gated is not None and gated not in GATED_KINDS:
        raise ValueError(f"unknown gated activation {gated!r}; expected one of {tuple(GATED_KINDS)}")
    if gated is not None and x.shape[1] != 2 * weight.shape[-1]:
        raise ValueError(f"a gated x {list(x.shape)} needs a weight [N, {x.shape[1] // 2}] for its gated half, "
                         f"not {list(weight.shape)}")
    return _launch(x, weight, tiling, bias, gated, None, None)[0]


def normed_dense_gemv(x: torch.Tensor, norm: RowNorm, weight: torch.Tensor, tiling: GemvTiling,
                      bias: torch.Tensor | None = None, gate_output: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`Ops.rms_norm_linear` as `dense_gemv` computes a product: (rms_norm(s) @ weight.T (+ bias), s) for
    s = x + norm.residual rounded to x's dtype, or x itself without a residual. Each row reads the whole
    weight: meant for one.
    With `gate_output` (an `Ops.gated_linear` activation) the weight [2I, K] is a gated MLP's gate and up
    rows and the product [M, I] its gated values, act(gate) * up, from the float32 sums (`split_k.store_tile`):
    the activation's kernel and the trip of both halves through memory are gone."""
    norm.check(x)
    return _launch(x.contiguous(), weight, tiling, bias, None, norm, gate_output)


def _launch(x, weight, tiling, bias, gated, norm, gate_output):
    rows, width = x.shape
    if gated is not None:
        width //= 2
    columns = weight.shape[0]
    if gate_output is not None and (gate_output not in GATED_KINDS or columns % 2 or tiling.block_n < 2):
        raise ValueError(f"a gated output ({gate_output!r}, one of {tuple(GATED_KINDS)}) takes a weight of an even "
                         f"number of rows, gate then up ({columns}), in tiles of at least one pair "
                         f"(block_n {tiling.block_n})")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"the dense GEMV takes float16 or bfloat16 x and weight of one dtype, not {x.dtype} and "
                         f"{weight.dtype}")
    if weight.ndim != 2 or weight.shape[1] != width or weight.stride(1) != 1:
        raise ValueError(f"x [{rows}, {width}] does not match a weight [N, {width}] with unit stride along K "
                         f"({list(weight.shape)}, strides {list(weight.stride())})")
    if not fits(weight):
        raise ValueError(f"a weight of {list(weight.shape)} (rows {weight.stride(0)} apart) spans more than the "
                         f"GEMV's 32-bit offsets reach ({MOST_ELEMENTS} elements)")
    if bias is not None and (bias.shape != (columns,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous [{columns}], not {list(bias.shape)}")
    steps, ragged = divmod(width, tiling.block_k)
    if ragged or tiling.block_k % VECTOR or not splittable(steps, tiling.split_k):
        raise ValueError(f"block_k {tiling.block_k} (a multiple of {VECTOR}) must divide K = {width} into steps, "
                         f"and split_k {tiling.split_k} split them with a step for each split")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, columns if gate_output is None else columns // 2, dtype=x.dtype, device=x.device)
    residual = None if norm is None else norm.residual
    joined = norm.joined_like(x) if norm is not None else x
    if rows == 0 or columns == 0:
        return out, joined
    tiles_n = triton.cdiv(out.shape[1], tiling.block_n if gate_output is None else tiling.block_n // 2)
    partials = partial_sums(out, tiling.split_k, columns)
    squares = partial_squares(out, tiling.split_k, rows * tiles_n, norm is not None)
    arrivals = arrival_counts(x.device, rows * tiles_n if tiling.split_k > 1 else 1)
    _dense_gemv_kernel[(tiles_n, tiling.split_k, rows)](
        x, weight, out if bias is None else bias, out, partials, arrivals, squares,
        *(RowNorm.absent(x) if norm is None else norm.kernel_arguments(x, joined)),
        columns, steps_a_split(steps, tiling.split_k), steps,
        x.stride(0), weight.stride(0), out.stride(0), rows * columns, width,
        BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, VECTOR=VECTOR, SPLIT=tiling.split_k > 1,
        PREFETCH=tiling.num_stages > 1, HAS_BIAS=bias is not None,
        GATE=NO_GATE.value if gated is None else GATED_KINDS[gated], NORM=norm is not None,
        RESIDUAL=residual is not None, GATE_OUT=NO_GATE.value if gate_output is None else GATED_KINDS[gate_output],
        num_warps=tiling.num_warps, num_stages=1, **launch_options(x.device),
    )  # fmt: skip
    return out, joined


def fitted_tile(block_n: int, block_k: int, width: int) -> tuple[int, int] | None:
    """A [block_n, block_k] tile whose depth divides K: block_k halved until it does, block_n doubled as often,
    so a thread keeps as many weights a step (with fewer, a step's fixed instructions weigh more: 16 x 128
    at 2 warps issued 4.6 a weight and spilled on sm_90a, 32 x 128 4.2); None where not even VECTOR does."""
    while block_k >= VECTOR:
        if width % block_k == 0:
            return block_n, block_k
        block_n, block_k = block_n * 2, block_k // 2
    return None


def fits(weight: torch.Tensor) -> bool:
    """Whether the GEMV's 32-bit offsets reach every element of `weight` [N, K]."""
    return weight.shape[0] * weight.stride(0) <= MOST_ELEMENTS


def chosen_tiling(x: torch.Tensor, weight, gated: bool = False) -> GemvTiling | None:
    """The GEMV tiling this GPU's dense table chose for x @ weight.T (for a `gated` x [.., 2K], its gated
    values'), or None where cuBLAS serves it: more than one row, another dtype, a shape the table does not
    hold or gave to cuBLAS, a GPU without a table, CANDELABRA_DENSE_GEMV=0."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or x.dtype not in DTYPES:
        return None
    width = weight.shape[1]
    inputs = 2 * width if gated else width
    if (x.shape[-1] != inputs or x.numel() != inputs or weight.dtype != x.dtype or weight.stride(1) != 1
            or not fits(weight)):
        return None
    name = gpu_name(x.device)
    if name is None or os.environ.get(SWITCH, "1").strip() == "0":
        return None
    return measured_tilings(name, "dense").get((weight.shape[0], width))
