"""The GEMV kernels' tilings measured on this GPU at start-up, for each of the model's weight shapes that
the GPU model's tables (kernels/gemv_tilings) lack: the int4 GEMV's, and for 16-bit weights whether our
GEMV (kernels/dense_gemv) or cuBLAS serves a one-row product. Each candidate times one product with each
of the model's weights of that shape in turn (the layers' own weights, read one after another as a step
reads them), replayed from a CUDA graph; the fastest whose product matches the reference's is kept, and
saved in the user's table, where the next start finds it. Each shape is timed as serving makes it: a
projection of an RMS norm's output as `Ops.rms_norm_linear` does (the GEMV normalising x as it loads it,
against the norm's kernel and cuBLAS); a gated MLP's gate and up weight after its norm as
`Ops.rms_norm_gated_mlp` does (the GEMV normalising x and writing the gated values, against the norm's
kernel, cuBLAS and the activation's kernel); its down projection plain where that GEMV serves gate and up,
else as `Ops.gated_linear` runs it (the GEMV computing the activation as it loads x, against the activation's
kernel and cuBLAS). CANDELABRA_GEMV_TUNING=0 leaves the int4 fallback
tiling and cuBLAS in place; CANDELABRA_GEMV_TUNING=all measures every shape again, those the tables hold too
(after a driver, Triton or kernel change), and the user's table then holds them all."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from candelabra.backends.cuda.availability import gpu_name, interpreting, multiprocessor_count
from candelabra.backends.cuda.kernels import activations, dense_gemv, gemv_tilings, norms
from candelabra.backends.cuda.kernels import int4_matmul as kernel
from candelabra.backends.cuda.kernels.split_k import splits_for
from candelabra.backends.cuda.quantized import Int4CudaWeight
from candelabra.core.models.base import gated_activation

log = logging.getLogger("candelabra")

# (block_n, block_k, warps, stages): the forms that were fastest at some shape on an H200, and their
# neighbours (bench/results/h200-2026-11-27/int4-tiles.log), each split for 2, 4 and 8 programs an SM.
CANDIDATES = ((16, 512, 2, 1), (16, 512, 2, 2), (32, 512, 2, 1), (32, 512, 4, 1), (64, 512, 4, 1),
              (32, 256, 2, 1))
# The 16-bit GEMV's: 64 weights (128 bytes) a thread a step, in tiles from 4 outputs 1,024 deep to 32
# outputs 256 deep, loaded ahead or not; shallower and wider where K needs it. On an H200 4 x 1024 won at
# Llama-3-8B's qkv and attention output, 8 x 512 elsewhere (bench/results/h200-2026-11-27-afternoon).
DENSE_CANDIDATES = ((8, 512, 2, 1), (8, 512, 2, 2), (16, 256, 2, 1), (16, 512, 4, 1), (32, 256, 4, 1),
                    (4, 1024, 2, 1))
PROGRAMS_PER_SM = (2, 4, 8)
# A tiling whose product differs more than this from the reference's is broken (both round the same float32
# sums, taken in other orders, to the compute dtype; a broken one is off by the order of the product
# itself), and left out.
MOST_NMSE = 1e-4
SWITCH = "CANDELABRA_GEMV_TUNING"
EVERY_SHAPE = "all"

Stopwatch = Callable[[Sequence[Callable[[], object]]], float]  # µs a call of the calls given
Measured = dict[tuple[int, int], gemv_tilings.GemvTiling | None]  # by [N, K]; None: cuBLAS (dense)


def tune_missing_shapes(model, device: torch.device) -> dict[str, Measured]:
    """Measure and save, per kind of weight ("int4", "dense"), the GEMV tilings of `model`'s linear shapes
    that this GPU's tables lack (every one with CANDELABRA_GEMV_TUNING=all); what was measured (a dense
    shape's None: cuBLAS was faster). Nothing on CPU tensors, under the interpreter, or with
    CANDELABRA_GEMV_TUNING=0. A failure is logged and leaves the fallback in place: serving goes on."""
    switch = os.environ.get(SWITCH, "1").strip().lower()
    if device.type != "cuda" or interpreting() or switch == "0":
        return {}
    name = gpu_name(device)
    measured_by_kind = {}
    for kind in ("int4", "dense"):
        known = {} if switch == EVERY_SHAPE else gemv_tilings.measured_tilings(name, kind)
        measure = fastest_tilings if kind == "int4" else partial(
            fastest_dense, gated=gated_downs(model), normed=normed_projections(model), mlps=gated_mlps(model),
            known=known)
        missing = {shape: weights for shape, weights in weights_by_shape(model, kind).items() if shape not in known}
        if not missing:
            continue
        started = time.perf_counter()
        what = "int4 GEMV's tilings" if kind == "int4" else "16-bit GEMV against cuBLAS"
        try:
            measured = measure(missing, device, graph_median_us)
            path = save(name, measured, kind, next(iter(missing.values()))[0].dtype)
        except Exception as exc:  # the fallback serves as well as before: a slower start, not a failed one
            log.warning("cuda: measuring the %s on %s failed (%s: %s); the %s serves", what, name,
                        type(exc).__name__, exc, "fallback tiling" if kind == "int4" else "cuBLAS product")
            continue
        log.info("cuda: the %s for %d weight shapes measured on %s in %.1f s, saved to %s (%s=0 skips this)",
                 what, len(measured), name, time.perf_counter() - started, path, SWITCH)
        measured_by_kind[kind] = measured
    return measured_by_kind


def weights_by_shape(model, kind: str = "int4") -> dict[tuple[int, int], list]:
    """The model's linear weights of `kind` (int4: Int4CudaWeight; dense: float16 and bfloat16 matrices) in
    its layers, their parts, and the LM head, by [N, K]."""
    found: dict[tuple[int, int], list] = {}
    seen: set[int] = set()

    def wanted(value) -> bool:
        if kind == "int4":
            return isinstance(value, Int4CudaWeight)
        return (isinstance(value, torch.Tensor) and value.ndim == 2 and value.dtype in dense_gemv.DTYPES
                and dense_gemv.fits(value))

    def visit(value, depth: int) -> None:
        if wanted(value):
            if id(value) not in seen:
                seen.add(id(value))
                found.setdefault(tuple(value.shape), []).append(value)
        elif depth and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for part in dataclasses.fields(value):
                visit(getattr(value, part.name), depth - 1)

    for layer in getattr(model, "layers", ()):
        visit(layer, 2)
    visit(getattr(model, "lm_head", None), 0)
    return found


def gated_downs(model) -> dict[tuple[int, int], str]:
    """[N, K] of the 16-bit down projections `model`'s gated MLPs multiply through `Ops.gated_linear`
    (the GEMV computing the activation as it loads x), each with its activation."""
    config = getattr(model, "config", None)
    if not getattr(model, "gated_mlp", False) or config is None:
        return {}
    activation = gated_activation(config.hidden_act)
    return {tuple(layer.mlp_out.shape): activation for layer in getattr(model, "layers", ())
            if getattr(layer, "experts", None) is None and isinstance(layer.mlp_out, torch.Tensor)
            and layer.mlp_out.ndim == 2}


def gated_mlps(model) -> dict[tuple[int, int], tuple[tuple[int, int], str]]:
    """[N, K] of the 16-bit gate and up weights of `model`'s gated MLPs after an RMS norm, which it multiplies
    through `Ops.rms_norm_gated_mlp` (the GEMV normalising x and writing the gated values), each with its down
    projection's [N, K] and its activation."""
    config = getattr(model, "config", None)
    if not getattr(model, "gated_mlp", False) or config is None or getattr(model, "norm_kind", None) != "rms":
        return {}
    activation = gated_activation(config.hidden_act)
    return {tuple(layer.mlp_in.shape): (tuple(layer.mlp_out.shape), activation) for layer in model.layers
            if getattr(layer, "experts", None) is None
            and all(isinstance(w, torch.Tensor) and w.ndim == 2 for w in (layer.mlp_in, layer.mlp_out))}


def normed_projections(model) -> frozenset[tuple[int, int]]:
    """[N, K] of the 16-bit projections of an RMS norm's output in `model`, which it makes through
    `Ops.rms_norm_linear` (the GEMV normalising x as it loads it): attention's first projection, a dense
    MLP's first, the LM head."""
    if getattr(model, "norm_kind", None) != "rms" or not hasattr(model, "attention_projection"):
        return frozenset()
    weights = [model.attention_projection(layer)[0] for layer in model.layers]
    weights += [layer.mlp_in for layer in model.layers if layer.experts is None]
    weights.append(model.lm_head)
    return frozenset(tuple(w.shape) for w in weights if isinstance(w, torch.Tensor) and w.ndim == 2)


def fastest_tilings(by_shape: dict[tuple[int, int], list[Int4CudaWeight]], device: torch.device,
                    stopwatch: Stopwatch) -> dict[tuple[int, int], gemv_tilings.GemvTiling]:
    """Each shape's candidate int4 tiling that `stopwatch` timed fastest over that shape's weights (each
    shape's time logged beside the fallback tiling's)."""
    sm_count = multiprocessor_count(device)
    chosen = {}
    for (columns, width), weights in by_shape.items():
        group = max(width // weight.scales.shape[1] for weight in weights)
        x = torch.randn(1, width, device=weights[0].device, dtype=weights[0].dtype)
        fallback = kernel.choose_config(1, columns, width, device, x.dtype, group)
        expected = kernel.int4_matmul(x, weights[0].packed, weights[0].scales, weights[0].zeros, fallback).float()

        def product_time(config, x=x, weights=weights) -> float:
            return stopwatch([lambda w=w: kernel.int4_matmul(x, w.packed, w.scales, w.zeros, config)
                              for w in weights])

        timed = {}
        for config in int4_candidates(columns, width, group, sm_count):
            got = kernel.int4_matmul(x, weights[0].packed, weights[0].scales, weights[0].zeros, config)
            if _matches(got, expected, config, (columns, width)):
                timed[config] = product_time(config)
        if not timed:
            continue
        best = min(timed, key=timed.get)
        fallback_us = timed.get(fallback) or product_time(fallback)
        log.info("cuda: int4 [%d, %d] x %d weights, one row: the fallback tiling %.1f µs (%s), the best %.1f µs (%s)",
                 columns, width, len(weights), fallback_us, _label(fallback.gemv_tiling()), timed[best],
                 _label(best.gemv_tiling()))
        chosen[columns, width] = best.gemv_tiling()
    return chosen


def fastest_dense(by_shape: dict[tuple[int, int], list[torch.Tensor]], device: torch.device,
                  stopwatch: Stopwatch, gated: dict[tuple[int, int], str] | None = None,
                  normed: frozenset[tuple[int, int]] = frozenset(),
                  mlps: dict[tuple[int, int], tuple[tuple[int, int], str]] | None = None,
                  known: dict[tuple[int, int], gemv_tilings.GemvTiling | None] | None = None) -> Measured:
    """Per shape of 16-bit weights, the 16-bit GEMV's tiling that `stopwatch` timed fastest over that
    shape's weights, or None where cuBLAS's product was faster than all of them (each shape's times logged).
    A shape in `normed` is timed as `Ops.rms_norm_linear` runs it after a residual add: the norm in the GEMV,
    against the norm's kernel then cuBLAS; one in `mlps` (a gated MLP's gate and up, with its down projection
    and activation) as `Ops.rms_norm_gated_mlp` does, the GEMV also writing the gated values, against the
    activation's kernel after cuBLAS. Its down projection, in `gated` by its activation, is timed plain where
    the GEMV serves that gate and up (measured here first, or in `known`, the GPU's table), else as
    `Ops.gated_linear` runs it: the activation computed in the GEMV, against the activation's kernel then
    cuBLAS."""
    sm_count = multiprocessor_count(device)
    mlps, known = mlps or {}, known or {}
    chosen = {}
    # gate and up first: how they are served says how their down projections are
    for (columns, width), weights in sorted(by_shape.items(), key=lambda item: item[0] not in mlps):
        gate_output = mlps[columns, width][1] if (columns, width) in mlps else None
        activation = (gated or {}).get((columns, width))
        if activation is not None and any(down == (columns, width) and {**known, **chosen}.get(gate_up) is not None
                                          for gate_up, (down, _) in mlps.items()):
            activation = None
        by_cublas, by_gemv, what = _one_row_products(width, weights[0], activation,
                                                     (columns, width) in normed or gate_output is not None,
                                                     gate_output)
        expected = by_cublas(weights[0]).float()
        cublas = stopwatch([partial(by_cublas, w) for w in weights])
        timed = {}
        for tiling in dense_candidates(columns, width, sm_count):
            if not _matches(by_gemv(weights[0], tiling), expected, tiling, (columns, width)):
                continue
            timed[tiling] = stopwatch([partial(by_gemv, w, tiling) for w in weights])
        best = min(timed, key=timed.get) if timed else None
        faster = best is not None and timed[best] < cublas
        log.info("cuda: [%d, %d] x %d weights, one row%s: cuBLAS %.1f µs, the 16-bit GEMV's best %s; %s serves",
                 columns, width, len(weights), what, cublas,
                 f"{timed[best]:.1f} µs ({_label(best)})" if best else "(none fits K)",
                 "the GEMV" if faster else "cuBLAS")
        chosen[columns, width] = best if faster else None
    return chosen


def _one_row_products(width: int, like: torch.Tensor, activation: str | None, normed: bool,
                      gate_output: str | None = None):
    """(cuBLAS's product of a weight, the GEMV's at a tiling, what precedes the product in words) for one row
    of random x, as serving makes that product: of a gated x's activation, of a norm's output (gated after,
    with `gate_output`), or of x."""
    def randn(*shape):
        return torch.randn(*shape, device=like.device, dtype=like.dtype)

    if gate_output:
        x, residual, weight = randn(1, width), randn(1, width), randn(width)
        norm = norms.RowNorm(weight, 1e-6, 0.0, residual)
        return (lambda w: activations.gated(F.linear(norms.add_rms_norm(x, residual, weight, 1e-6)[0], w),
                                            gate_output),
                lambda w, tiling: dense_gemv.normed_dense_gemv(x, norm, w, tiling, gate_output=gate_output)[0],
                f", x normalised after a residual add, {gate_output}-gated output")

    if activation:
        x = randn(1, 2 * width)
        return (lambda w: F.linear(activations.gated(x, activation), w),
                lambda w, tiling: dense_gemv.dense_gemv(x, w, tiling, gated=activation), f", {activation}-gated x")
    if normed:
        x, residual, weight = randn(1, width), randn(1, width), randn(width)
        norm = norms.RowNorm(weight, 1e-6, 0.0, residual)
        return (lambda w: F.linear(norms.add_rms_norm(x, residual, weight, 1e-6)[0], w),
                lambda w, tiling: dense_gemv.normed_dense_gemv(x, norm, w, tiling)[0],
                ", x normalised after a residual add")
    x = randn(1, width)
    return (lambda w: F.linear(x, w), lambda w, tiling: dense_gemv.dense_gemv(x, w, tiling), "")


def int4_candidates(columns: int, width: int, group: int, sm_count: int) -> list:
    """The int4 GEMV launches (TileConfig) start-up measurement tries at [N, K] with scale groups of `group`
    on a GPU of `sm_count` SMs: each of CANDIDATES whose step covers whole groups and divides K, split for
    each of PROGRAMS_PER_SM, without repeats."""
    configs = []
    for block_n, block_k, warps, stages in CANDIDATES:
        if block_k % group or width % block_k:
            continue
        for per_sm in PROGRAMS_PER_SM:
            config = kernel.split_for_programs(kernel.TileConfig(1, block_n, block_k, num_warps=warps,
                                                                 num_stages=stages),
                                               1, columns, width, per_sm * sm_count, group)
            if config not in configs:
                configs.append(config)
    return configs


def dense_candidates(columns: int, width: int, sm_count: int) -> list[gemv_tilings.GemvTiling]:
    """The 16-bit GEMV tilings start-up measurement tries at [N, K] on a GPU of `sm_count` SMs: each of
    DENSE_CANDIDATES fitted to K, split for each of PROGRAMS_PER_SM, without repeats."""
    tilings = []
    for widest, deepest, warps, stages in DENSE_CANDIDATES:
        tile = dense_gemv.fitted_tile(widest, deepest, width)
        if tile is None:
            continue
        block_n, block_k = tile
        for per_sm in PROGRAMS_PER_SM:
            split = splits_for(-(-columns // block_n), width // block_k, per_sm * sm_count)
            tiling = gemv_tilings.GemvTiling(block_n, block_k, split, warps, stages)
            if tiling not in tilings:
                tilings.append(tiling)
    return tilings


def _label(tiling: gemv_tilings.GemvTiling) -> str:
    return (f"{tiling.block_n} x {tiling.block_k}, {tiling.num_warps} warps, K in {tiling.split_k}, "
            f"{'loaded ahead' if tiling.num_stages > 1 else 'in turn'}")


def _matches(got: torch.Tensor, expected: torch.Tensor, tiling, shape: tuple[int, int]) -> bool:
    error = float(((got.float() - expected) ** 2).mean())
    if error <= MOST_NMSE * max(float((expected ** 2).mean()), 1e-30):
        return True
    log.warning("cuda: GEMV tiling %s gives another product at [%d, %d]; left out", tiling, *shape)
    return False


def save(name: str, measured: Measured, kind: str = "int4",
         dtype: torch.dtype = torch.bfloat16):
    """`measured` added to `name`'s `kind` table in the user's folder; its path."""
    path, _ = gemv_tilings.save_measured(name, measured, f"{time.strftime('%Y-%m-%d')}, measured at start-up over "
                                         f"the weights of a served model, one row, {str(dtype).removeprefix('torch.')}",
                                         kind)
    return path


def graph_median_us(calls: Sequence[Callable[[], object]], repeats: int = 7) -> float:
    """Median µs of one call, from replays of a CUDA graph holding every call in `calls` once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compiles and warms up outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]
