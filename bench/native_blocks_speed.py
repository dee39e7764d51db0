"""GGUF weights multiplied as stored (backends/torch/cpu/block_products.py) against torch's CPU kernels, on
the default model's real weights.

    python bench/native_blocks_speed.py [--rows 1 4 16 64] [--repeats 9] [--threads T]
                                        [--weights ffn_gate ffn_down_q6_k ffn_down_q4_k attn_q output]
    python bench/native_blocks_speed.py --overhead

For each kind of weight (one tensor name and format, in every layer that has it) and each number of
rows M, every candidate is timed in turn, one call each, round after round, and the median of the
rounds is reported (with the fastest), so that other work on a shared machine disturbs all candidates
alike. Before each round the script waits (up to --quiet-wait-s) for the machine's other processes to
leave the cores idle: a multi-threaded kernel whose second thread is descheduled waits a whole
scheduler slice at its closing barrier (16 ms instead of 0.2). Each call multiplies the next weight of
a pool of copies larger than the last-level cache (POOL_BYTES), so the weight comes from memory, as in
a decode step.

Candidates: blocks_float and blocks_int8 with bfloat16 and float32 x; blocks_int8 called once per row
of x (what reading each weight block once for all rows saves, from 4 rows); blocks_rebuild (slices
decoded to float32 for a GEMM, from 16 rows); torch's int8 weight-only kernel on per-row int8 values
(bfloat16: what quantized.py keeps for Q5_0, Q8_0 and Q6_K); torch's int4 kernel (Q4_K, bfloat16);
dense F.linear in float32 and bfloat16. GB/s: bytes of the form each candidate reads (blocks; int8
values and scales; packed int4 with scales and zeros; dense values) over the median time; "of read": that
over the read bandwidth measured in the same run by the kernel library's plain read of a pool (issue 53's
goal: 60% at one row).

--threads 1 --cpu-time: one thread's CPU time instead of the wall clock, for a machine others keep busy.

--variants avx2 portable: blocks_float and blocks_int8 in float32 also in those installed ISA variants
(kernel_build.VARIANTS) this CPU runs: the code a CPU without AVX-512, or without AVX2, runs, timed on this
one. --float-tiles 4 16: the same for this CPU's variant built for the run with those rows of x a tile
(`FLOAT_TILE`), and --build-flags (repeatable) with those extra compiler flags.

--overhead: microseconds per call on a tiny weight (64 x 256, M = 1): the fixed cost a decode step
pays about 100 times.

--errors: NMSE of each kernel's output against x @ W.T in float64 (W as gguf decodes it), for every
format the kernels read on conformance's random blocks (896 x 4864) and on the default model's real
tensors, x of 16 standard normal rows, and the same x with four channels a hundred times larger
(Qwen's outlying activation channels); with conformance's threshold for the format, and the error of
the per-row int8 weights quantized.py keeps instead (its product taken exactly), for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader

from candelabra.backends.torch.cpu import kernel_build, kernel_library
from candelabra.backends.torch.cpu.block_products import NATIVE_FORMATS, NativeBlocksWeight, native_blocks_available
from candelabra.backends.torch.cpu.features import cpu_model_name
from candelabra.backends.torch.quantized import int4_groupwise, int8_rowwise
from candelabra.backends.torch.weight_forms import Int4Weight
from candelabra.core.contract.weights import QuantizedTensor
from candelabra.core.text_table import format_table
from candelabra.core.weights.default_model import default_model_path

POOL_BYTES = 96 << 20  # three times a 32 MiB last-level cache, per candidate
# kind: (tensor name, format), the default model's tensors of that name and format in every layer
WEIGHTS = {
    "ffn_gate": ("ffn_gate", "Q5_0"),
    "ffn_down_q6_k": ("ffn_down", "Q6_K"),
    "ffn_down_q4_k": ("ffn_down", "Q4_K"),
    "attn_q": ("attn_q", "Q5_0"),
    "output": ("output", "Q8_0"),
}
HEADERS = ("weight", "M", "candidate", "median ms", "fastest ms", "GB/s", "of read")


@dataclass
class Candidate:
    name: str
    dtype: torch.dtype
    pool: list  # weights in the candidate's form, cycled through
    nbytes: int  # bytes of one weight in that form
    multiply: Callable[[object, torch.Tensor], torch.Tensor]
    from_rows: int = 1  # timed only at this many rows and more


def read_weights(reader: GGUFReader, name: str, format: str) -> list[QuantizedTensor]:
    found = []
    for t in reader.tensors:
        base = t.name.removesuffix(".weight").split(".")[-1]
        if base == name and t.tensor_type.name == format:
            shape = (int(t.shape[1]), int(t.shape[0]))
            found.append(QuantizedTensor(format, np.array(t.data, dtype=np.uint8), shape))
    return found


def pooled(make: Callable[[QuantizedTensor], object], weights: list[QuantizedTensor], nbytes: int) -> list:
    """Forms of the weights, repeated (as fresh copies) until the pool holds POOL_BYTES, at least two."""
    count = max(2, -(-POOL_BYTES // max(nbytes, 1)))
    return [make(weights[i % len(weights)]) for i in range(count)]


def int8_rows(weight: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, scales = int8_rowwise(weight.dequantize())
    return torch.from_numpy(values), torch.from_numpy(scales).to(torch.bfloat16)


def variant_builds(names: list[str], flags: dict[str, tuple[str, ...]], folder: str) -> dict[str, object]:
    """The installed variants `names`, and this CPU's variant built with each entry's extra compiler flags
    into `folder`."""
    builds = {}
    for name in names:
        build = kernel_library.kernels(name)
        if build.library is None:
            raise SystemExit(f"the {name} kernels do not load here: {build.detail}")
        builds[name] = build
    variant = next(v for v in kernel_build.VARIANTS if v.name == kernel_library.kernels().variant)
    for index, (name, extra) in enumerate(flags.items()):
        path = Path(folder) / str(index) / variant.library_name
        error = kernel_build.build(variant, path, extra_flags=extra)
        build = kernel_library.load_file(path, variant.name) if error is None else None
        if build is None or build.library is None:
            raise SystemExit(f"the library built with {' '.join(extra)} did not build: {error or build.detail}")
        builds[name] = build
    return builds


def on_library(weight: NativeBlocksWeight, build) -> NativeBlocksWeight:
    """`weight` multiplied by another build of the kernel library."""
    weight._matmul, weight._decode = build.library.gguf_blocks_matmul, build.library.gguf_blocks_decode
    return weight


def candidates(weights: list[QuantizedTensor], variants: dict[str, object]) -> list[Candidate]:
    first = weights[0]
    rows, columns = first.shape
    blocks = first.blocks.nbytes
    found = []
    for variant, build in variants.items():
        pool = pooled(lambda w, build=build: on_library(NativeBlocksWeight.from_quantized(w, torch.float32), build),
                      weights, blocks)
        found.append(Candidate(f"blocks_float f32 {variant}", torch.float32, pool, blocks, lambda w, x: w._float(x)))
        found.append(Candidate(f"blocks_int8 f32 {variant}", torch.float32, pool, blocks, lambda w, x: w._int8(x)))
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        pool = pooled(lambda w, dtype=dtype: NativeBlocksWeight.from_quantized(w, dtype), weights, blocks)
        found.append(Candidate(f"blocks_float {tag}", dtype, pool, blocks, lambda w, x: w._float(x)))
        found.append(Candidate(f"blocks_int8 {tag}", dtype, pool, blocks, lambda w, x: w._int8(x)))
        if dtype == torch.float32:
            found.append(Candidate("blocks_int8 f32, row by row", dtype, pool, blocks,
                                   lambda w, x: torch.cat([w._int8(row) for row in x.split(1)]), from_rows=4))
            found.append(Candidate("blocks_rebuild f32", dtype, pool, blocks,
                                   lambda w, x: w.kernels()["blocks_rebuild"](x), from_rows=16))
    if first.format == "Q4_K":
        pool = pooled(lambda w: Int4Weight.from_groups(*int4_groupwise(w), torch.bfloat16), weights, rows * columns)
        size = pool[0].packed.numel() + 2 * pool[0].scales_and_zeros.numel()
        found.append(Candidate("int4_mm bf16", torch.bfloat16, pool, size, lambda w, x: w._int4_mm(x)))
    else:
        pool = pooled(int8_rows, weights, rows * columns)
        found.append(Candidate("int8_mm bf16 (int8 rows)", torch.bfloat16, pool, rows * columns + 2 * rows,
                               lambda w, x: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])))
    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        size = rows * columns * dtype.itemsize
        pool = pooled(lambda w, dtype=dtype: torch.from_numpy(w.dequantize()).to(dtype), weights, size)
        found.append(Candidate(f"dense {tag}", dtype, pool, size, lambda w, x: F.linear(x, w)))
    return found


def busy_cores(seconds: float = 0.05) -> float:
    """Cores the machine's processes kept busy over `seconds` (Linux /proc/stat), while this one slept."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    total, idle = sample()
    time.sleep(seconds)
    total2, idle2 = sample()
    return (os.cpu_count() or 1) * (1 - (idle2 - idle) / max(total2 - total, 1))


def wait_for_quiet(limit_s: float, threshold: float = 0.15) -> bool:
    """Waits until others keep less than `threshold` of a core busy, at most `limit_s`; whether they did."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if busy_cores() < threshold:
            return True
    return False


def read_bandwidth(repeats: int) -> float:
    """GB/s this run's threads read from memory (the kernel library's `candelabra_read_words` over four pools,
    each read once a round, the median of the rounds): the bound a product that reads its weight once can
    approach."""
    library = kernel_library.kernels().library
    pools = [np.random.default_rng(index).integers(0, 2**63, POOL_BYTES // 8, dtype=np.uint64) for index in range(4)]
    seconds = []
    for _ in range(max(repeats, 5)):
        for pool in pools:
            started = time.perf_counter()
            library.candelabra_read_words(pool.ctypes.data, pool.size, torch.get_num_threads())
            seconds.append(time.perf_counter() - started)
    return POOL_BYTES / statistics.median(seconds) / 1e9


def time_all(cands: list[Candidate], rows: int, columns: int, repeats: int, quiet_wait_s: float,
             clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of each candidate over `repeats` rounds, each candidate once a round on the next
    weight of its pool; and the rounds that started while other processes were busy."""
    rng = np.random.default_rng(rows)
    x32 = torch.from_numpy(rng.standard_normal((rows, columns)).astype(np.float32))
    mine = [c for c in cands if rows >= c.from_rows]
    xs = {c.name: x32.to(c.dtype) for c in mine}
    seconds: dict[str, list[float]] = {c.name: [] for c in mine}
    for c in mine:  # one untimed call each
        c.multiply(c.pool[0], xs[c.name])
    busy = 0
    for position in range(repeats):
        busy += not wait_for_quiet(quiet_wait_s)
        spin_until = time.perf_counter() + 0.005  # a core woken from idle runs slowly at first
        while time.perf_counter() < spin_until:
            pass
        for c in mine[position % len(mine):] + mine[:position % len(mine)]:  # each candidate first in turn
            weight = c.pool[(position + 1) % len(c.pool)]
            start = clock()
            c.multiply(weight, xs[c.name])
            seconds[c.name].append(clock() - start)
    return seconds, busy


def overhead(repeats: int = 20000) -> None:
    from candelabra.conformance.quantized_weights import random_quantized

    rng = np.random.default_rng(0)
    weight = random_quantized(rng, "Q5_0", 64, 256)
    lines = []
    for dtype in (torch.bfloat16, torch.float32):
        kept = NativeBlocksWeight.from_quantized(weight, dtype)
        x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32)).to(dtype)
        dense = torch.from_numpy(weight.dequantize()).to(dtype)
        calls = {"blocks_float": kept._float, "blocks_int8": kept._int8, "matmul (its chosen kernel)": kept.matmul,
                 "F.linear, for scale": lambda x, dense=dense: F.linear(x, dense)}
        for name, call in calls.items():
            for _ in range(1000):
                call(x)
            start = time.thread_time()
            for _ in range(repeats):
                call(x)
            microseconds = (time.thread_time() - start) / repeats * 1e6
            lines.append((name, str(dtype).removeprefix("torch."), f"{microseconds:.1f}"))
    print(format_table(("call, 64 x 256 Q5_0, M = 1", "dtype", "CPU us per call"), lines))


def errors() -> None:
    from candelabra.conformance.compare import QUANTIZED_NMSE_THRESHOLDS
    from candelabra.conformance.quantized_weights import random_quantized

    rng = np.random.default_rng(0)
    weights = [("random", random_quantized(rng, format, 896, 4864)) for format in sorted(NATIVE_FORMATS)]
    reader = GGUFReader(default_model_path())
    for name, format in sorted(set(WEIGHTS.values()) - {("output", "Q8_0")}) + [("attn_v", "Q8_0")]:
        weights.append((f"{name} layer 0", read_weights(reader, name, format)[0]))
    x = rng.standard_normal((16, 4864))
    outlying = x.copy()
    outlying[:, rng.choice(4864, 4, replace=False)] *= 100
    lines = []
    for source, weight in weights:
        values = weight.dequantize().astype(np.float64)
        int8_values, int8_scales = int8_rowwise(values.astype(np.float32))
        int8_weight = int8_values * int8_scales[:, None].astype(np.float64)
        for x_name, x_all in (("normal", x), ("4 outlying channels", outlying)):
            x64 = x_all[:, : weight.shape[1]]
            reference = x64 @ values.T
            row = [weight.format, f"{source} {weight.shape[0]}x{weight.shape[1]}", x_name]
            for dtype in (torch.float32, torch.bfloat16):
                kept = NativeBlocksWeight.from_quantized(weight, dtype)
                xt = torch.from_numpy(x64).to(dtype)
                exact = xt.double().numpy() @ values.T  # the product of x as the kernel got it
                for kernel in ("blocks_float", "blocks_int8"):
                    row.append(f"{_nmse(kept.kernels()[kernel](xt).double().numpy(), exact):.1e}")
            row.append(f"{_nmse(x64 @ int8_weight.T, reference):.1e}")
            row.append(f"{QUANTIZED_NMSE_THRESHOLDS[weight.format]:g}")
            lines.append(row)
    print(format_table(("format", "weight", "x", "float f32", "int8 f32", "float bf16", "int8 bf16",
                        "int8 rows (kept today)", "threshold"), lines))


def _nmse(output: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sum(np.square(output - reference)) / np.sum(np.square(reference)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--quiet-wait-s", type=float, default=5.0, help="longest wait for idle cores per round")
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--errors", action="store_true")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1: time the thread's CPU time, which other processes barely move")
    parser.add_argument("--float-tiles", type=int, nargs="+", default=[], metavar="ROWS",
                        help="also time blocks_float in float32 built with these rows of x a tile")
    parser.add_argument("--build-flags", action="append", default=[], metavar="FLAGS",
                        help="also time blocks_float in float32 built with these extra compiler flags "
                             "(space-separated; repeatable), e.g. --build-flags=-DPREFETCH_BYTES=0")
    parser.add_argument("--variants", nargs="+", default=[], metavar="VARIANT",
                        help="also time these installed ISA variants (avx512, avx2, portable) this CPU runs")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time counts one thread's time: give --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    available, detail = native_blocks_available()
    print(f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; kernels: {detail}")
    if not available:
        return
    torch.set_grad_enabled(False)
    if args.overhead:
        overhead()
        return
    if args.errors:
        errors()
        return
    bandwidth = read_bandwidth(args.repeats)
    print(f"read bandwidth: {bandwidth:.1f} GB/s (the kernel library's read of {POOL_BYTES >> 20} MiB pools; "
          "\"of read\" is each candidate's GB/s over it)")
    reader = GGUFReader(default_model_path())
    lines = []
    builds_folder = tempfile.TemporaryDirectory()
    flags = {f"tile {tile}": (f"-DFLOAT_TILE={tile}",) for tile in args.float_tiles}
    flags.update({extra: tuple(extra.split()) for extra in args.build_flags})
    builds = variant_builds(args.variants, flags, builds_folder.name)
    for kind in args.weights:
        weights = read_weights(reader, *WEIGHTS[kind])
        rows, columns = weights[0].shape
        cands = candidates(weights, builds)
        for m in args.rows:
            seconds, busy = time_all(cands, m, columns, args.repeats, args.quiet_wait_s, clock)
            for c in cands:
                if c.name not in seconds:
                    continue
                median, fastest = statistics.median(seconds[c.name]), min(seconds[c.name])
                lines.append((f"{WEIGHTS[kind][0]} {weights[0].format} {rows}x{columns}", str(m), c.name,
                              f"{median * 1e3:.3f}", f"{fastest * 1e3:.3f}", f"{c.nbytes / median / 1e9:.1f}",
                              f"{c.nbytes / median / 1e9 / bandwidth:.0%}"))
            note = f" ({busy} of {args.repeats} rounds began while other processes were busy)" if busy else ""
            print(format_table(HEADERS, lines[-len(seconds):]) + note + "\n", flush=True)
        del cands
    print(format_table(HEADERS, lines))


if __name__ == "__main__":
    main()
