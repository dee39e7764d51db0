"""A decode step's attention on the torch backend (rotary embedding, cache write, attention: one layer's
`rotary_and_paged_attention`) in torch ops against the C kernel of backends/torch/cpu/decode_attention.py.

    python bench/decode_attention_speed.py [--batches 1 16 64] [--contexts 128 1024] [--rounds 21]
                                           [--heads 14 2] [--head-dim 64] [--dtype float32]
                                           [--build-flags=-mno-avx512f ...]

Each case times every candidate in turn, one call each, round after round, and reports the medians, so
that other work on a shared machine disturbs all candidates alike. The cache holds 32 layers' worth of
blocks, each call reading the next layer's, so keys come from memory at long contexts as in a step.
--build-flags (repeatable): the C kernel also as built with those extra flags (-mno-avx512f: the AVX2
code a CPU without AVX-512 runs, timed on this one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from candelabra.backends.torch import attention
from candelabra.backends.torch.attention import TorchStep
from candelabra.backends.torch.cpu import decode_attention, kernel_library
from candelabra.backends.torch.cpu.features import cpu_flags, cpu_model_name
from candelabra.backends.torch.ops import TorchOps
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.models.rope import cos_sin_table

LAYERS = 32
BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("Q_HEADS", "KV_HEADS"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--variants", nargs="+", default=[], metavar="VARIANT",
                        help="also time these installed ISA variants (avx512, avx2, portable) this CPU runs")
    args = parser.parse_args()
    available, detail = decode_attention.native_decode_attention_available()
    if not available:
        raise SystemExit(f"the C kernel is not available here: {detail}")
    dtype = getattr(torch, args.dtype)
    amx = "AMX" if "amx_tile" in cpu_flags() else "no AMX"
    print(f"{cpu_model_name()} ({amx}), {torch.get_num_threads()} threads, {args.dtype}, heads {args.heads[0]}/"
          f"{args.heads[1]} of {args.head_dim}; {detail}")
    builds = {"C": kernel_library.kernels()}
    for name in args.variants:
        build = kernel_library.kernels(name)
        if build.library is None:
            raise SystemExit(f"the {name} kernels do not load here: {build.detail}")
        builds[f"C {name}"] = build
    print("batch  context  " + "  ".join(f"{name + ' us':>22}" for name in ["torch ops", *builds])
          + "  torch / C")
    for batch in args.batches:
        for context in args.contexts:
            times = time_case(batch, context, args, dtype, builds)
            cells = "  ".join(f"{t:>22.1f}" for t in times)
            print(f"{batch:>5}  {context:>7}  {cells}  {times[0] / times[1]:>9.2f}")


def time_case(batch: int, context: int, args, dtype: torch.dtype, builds: dict) -> list[float]:
    torch.manual_seed(batch * 100003 + context)
    q_heads, kv_heads = args.heads
    per_sequence = -(-context // BLOCK_SIZE)
    tables = [list(range(s * per_sequence, (s + 1) * per_sequence)) for s in range(batch)]
    meta = StepMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE)
    step = TorchStep.prepare(meta, torch.device("cpu"))
    shape = (batch * per_sequence, BLOCK_SIZE, kv_heads, args.head_dim)
    caches = [KVCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    qkv = torch.randn(batch, (q_heads + 2 * kv_heads) * args.head_dim).to(dtype)
    q = qkv[:, :q_heads * args.head_dim].reshape(batch, q_heads, args.head_dim)
    k = qkv[:, q_heads * args.head_dim:(q_heads + kv_heads) * args.head_dim].reshape(batch, kv_heads, args.head_dim)
    v = qkv[:, (q_heads + kv_heads) * args.head_dim:].reshape(batch, kv_heads, args.head_dim)
    table = torch.from_numpy(cos_sin_table(args.head_dim, context + 1, 10000.0))
    ops = TorchOps(torch.device("cpu"))
    layer = iter(range(10**9))

    def call() -> None:
        ops.rotary_and_paged_attention(q, k, v, step.rope_positions, table, caches[next(layer) % LAYERS],
                                       step.slot_mapping, step, args.head_dim**-0.5)

    candidates = [lambda: on_torch_ops(call)] + [lambda build=build: on_build(call, build) for build in builds.values()]
    samples = [[] for _ in candidates]
    for _ in range(args.rounds + 2):  # two rounds to warm up
        for index, candidate in enumerate(candidates):
            samples[index].append(candidate())
    return [statistics.median(s[2:]) * 1e6 for s in samples]


def on_torch_ops(call) -> float:
    saved = decode_attention.reads_natively, attention.reads_natively
    decode_attention.reads_natively = attention.reads_natively = lambda cache: False
    try:
        return timed(call)
    finally:
        decode_attention.reads_natively, attention.reads_natively = saved


def on_build(call, build) -> float:
    saved = decode_attention.kernels
    decode_attention.kernels = lambda: build
    try:
        return timed(call)
    finally:
        decode_attention.kernels = saved


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
