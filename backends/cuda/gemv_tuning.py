"""The int4 GEMV's tiling measured on this GPU at start-up, for each of the model's weight shapes that the
GPU model's tables (kernels/gemv_tilings) lack. Each candidate tiling times one product with each of the
model's weights of that shape in turn (the layers' own weights, read one after another as a step reads
them), replayed from a CUDA graph; the fastest whose product matches the fallback's is kept, and saved in
the user's table, where the next start finds it. CANDELABRA_GEMV_TUNING=0 leaves the fallback in place."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from candelabra.backends.cuda.availability import gpu_name, interpreting, multiprocessor_count
from candelabra.backends.cuda.kernels import gemv_tilings
from candelabra.backends.cuda.kernels import int4_matmul as kernel
from candelabra.backends.cuda.quantized import Int4CudaWeight

log = logging.getLogger("candelabra")

# (block_n, block_k, warps, stages): the forms that were fastest at some shape on an H200, and their
# neighbours (bench/results/h200-2026-11-27/int4-tiles.log), each split for 2, 4 and 8 programs an SM.
CANDIDATES = ((16, 512, 2, 1), (16, 512, 2, 2), (32, 512, 2, 1), (32, 512, 4, 1), (64, 512, 4, 1),
              (32, 256, 2, 1))
PROGRAMS_PER_SM = (2, 4, 8)
# A tiling whose product differs more than this from the fallback's is broken (both round the same float32
# sums, taken in other orders, to the compute dtype; a broken one is off by the order of the product
# itself), and left out.
MOST_NMSE = 1e-4
SWITCH = "CANDELABRA_GEMV_TUNING"

Stopwatch = Callable[[Sequence[Callable[[], object]]], float]  # µs a call of the calls given


def tune_missing_shapes(model, device: torch.device) -> dict[tuple[int, int], gemv_tilings.GemvTiling]:
    """Measure and save the GEMV tilings of `model`'s int4 linear shapes that this GPU's tables lack; what
    was measured. Nothing on CPU tensors, under the interpreter, or with CANDELABRA_GEMV_TUNING=0. A failure
    is logged and leaves the fallback in place: serving goes on."""
    if device.type != "cuda" or interpreting() or os.environ.get(SWITCH, "1").strip() == "0":
        return {}
    name = gpu_name(device)
    known = gemv_tilings.measured_tilings(name)
    missing = {shape: weights for shape, weights in weights_by_shape(model).items() if shape not in known}
    if not missing:
        return {}
    started = time.perf_counter()
    try:
        measured = fastest_tilings(missing, device, graph_median_us)
        path = save(name, measured)
    except Exception as exc:  # the fallback tiling serves as well as before: a slower start, not a failed one
        log.warning("cuda: measuring the int4 GEMV's tilings on %s failed (%s: %s); its fallback tiling serves",
                    name, type(exc).__name__, exc)
        return {}
    log.info("cuda: the int4 GEMV's tilings for %d weight shapes measured on %s in %.1f s, saved to %s "
             "(%s=0 skips this)", len(measured), name, time.perf_counter() - started, path, SWITCH)
    return measured


def weights_by_shape(model) -> dict[tuple[int, int], list[Int4CudaWeight]]:
    """The model's int4 linear weights (its layers', theirs within a layer's parts, the LM head) by [N, K]."""
    found: dict[tuple[int, int], list[Int4CudaWeight]] = {}
    seen: set[int] = set()

    def visit(value, depth: int) -> None:
        if isinstance(value, Int4CudaWeight):
            if id(value) not in seen:
                seen.add(id(value))
                found.setdefault(value.shape, []).append(value)
        elif depth and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for part in dataclasses.fields(value):
                visit(getattr(value, part.name), depth - 1)

    for layer in getattr(model, "layers", ()):
        visit(layer, 2)
    visit(getattr(model, "lm_head", None), 0)
    return found


def fastest_tilings(by_shape: dict[tuple[int, int], list[Int4CudaWeight]], device: torch.device,
                    stopwatch: Stopwatch) -> dict[tuple[int, int], gemv_tilings.GemvTiling]:
    """Each shape's candidate tiling that `stopwatch` timed fastest over that shape's weights."""
    sm_count = multiprocessor_count(device)
    chosen = {}
    for (columns, width), weights in by_shape.items():
        group = max(width // weight.scales.shape[1] for weight in weights)
        x = torch.randn(1, width, device=device, dtype=weights[0].dtype)
        expected = kernel.int4_matmul(x, weights[0].packed, weights[0].scales, weights[0].zeros).float()
        timed = {}
        for block_n, block_k, warps, stages in CANDIDATES:
            if block_k % group or width % block_k:
                continue
            for per_sm in PROGRAMS_PER_SM:
                config = kernel.split_for_programs(
                    kernel.TileConfig(1, block_n, block_k, num_warps=warps, num_stages=stages), 1, columns, width,
                    per_sm * sm_count, group)
                if config in timed:
                    continue
                got = kernel.int4_matmul(x, weights[0].packed, weights[0].scales, weights[0].zeros, config).float()
                if not float(((got - expected) ** 2).mean()) <= MOST_NMSE * max(float((expected ** 2).mean()), 1e-30):
                    log.warning("cuda: GEMV tiling %s gives another product at [%d, %d]; left out", config, columns,
                                width)
                    continue
                timed[config] = stopwatch([lambda w=w, c=config, x=x: kernel.int4_matmul(x, w.packed, w.scales,
                                                                                         w.zeros, c)
                                           for w in weights])
        if timed:
            best = min(timed, key=timed.get)
            chosen[columns, width] = gemv_tilings.GemvTiling(best.block_n, best.block_k, best.split_k, best.num_warps,
                                                             best.num_stages)
    return chosen


def save(name: str, measured: dict[tuple[int, int], gemv_tilings.GemvTiling]):
    """`measured` added to `name`'s table in the user's folder; its path."""
    path = gemv_tilings.table_file(gemv_tilings.user_tables(), name)
    tilings = {**gemv_tilings.users_table(name), **measured}
    gemv_tilings.write_table(path, name, tilings, f"{time.strftime('%Y-%m-%d')}, measured at start-up over the "
                             "weights of a served model, one row")
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
