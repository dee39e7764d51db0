"""Paged attention and linear at decode shapes, numpy (cpu) and MLX (metal) side by side.

    python bench/ops_numpy_vs_metal.py [--repeats N] [--quick]

Prints milliseconds per call (median of N, after a warm-up) and metal's speed relative to numpy
in the same run (above 1x: metal is faster). MLX work is lazy, so each metal call is evaluated before the clock stops.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from candelabra.backends.cpu import CpuBackend
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.contract.weights import WeightRole
from candelabra.core.text_table import format_table
from candelabra.plugins import installed_plugins

# (label, heads, kv heads, head dim): Qwen2.5-0.5B and Llama-3-8B attention.
MODELS = [("qwen2.5-0.5b", 14, 2, 64), ("llama3-8b", 32, 8, 128)]
# (label, in features, out features): their MLP up-projections.
LINEARS = [("qwen2.5-0.5b up", 896, 4864), ("llama3-8b qkv", 4096, 6144)]


def timed(backend, call, repeats: int) -> float:
    backend.evaluate(call())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.evaluate(call())
        backend.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def attention_case(backend, dtype, rng, *, heads, kv_heads, head_dim, batch, context):
    block_size = 16
    blocks_per_seq = -(-context // block_size)
    tables = rng.permutation(batch * blocks_per_seq).reshape(batch, blocks_per_seq).tolist()
    meta = StepMetadata.build([1] * batch, [context] * batch, tables, block_size)
    spec = KVCacheSpec(1, batch * blocks_per_seq, block_size, kv_heads, head_dim, dtype)
    host = rng.standard_normal(spec.block_shape).astype(np.float32)
    cache = type(backend.allocate_kv_cache(spec)[0])(backend.to_device(host, dtype), backend.to_device(host, dtype))
    q = backend.to_device(rng.standard_normal((batch, heads, head_dim)), dtype)
    step = backend.prepare_step(meta)
    return lambda: backend.ops.paged_attention(q, cache, step, scale=head_dim**-0.5)


def linear_case(backend, dtype, rng, *, tokens, in_features, out_features):
    x = backend.to_device(rng.standard_normal((tokens, in_features)), dtype)
    weight = (rng.standard_normal((out_features, in_features)) * in_features**-0.5).astype(np.float32)
    w = backend.upload_weight("proj.weight", WeightRole.LINEAR, weight, dtype)
    return lambda: backend.ops.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="smaller contexts, fewer repeats")
    args = parser.parse_args()
    repeats = 5 if args.quick else args.repeats
    contexts = [256] if args.quick else [512, 2048]

    numpy_backend = CpuBackend()
    metal_class = installed_plugins().backends.get("metal")
    probe = metal_class.probe()
    if not probe.available:
        raise SystemExit(f"metal backend unavailable: {probe.reason}")
    metal = metal_class()
    print(f"numpy {np.__version__} (float32) vs metal on {probe.detail}; median of {repeats}, ms per call")
    rng = np.random.default_rng(0)

    rows = []
    for label, heads, kv_heads, head_dim in MODELS:
        for batch in (1, 16):
            for context in contexts:
                make = functools.partial(attention_case, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                         batch=batch, context=context)
                rows.append(_row(f"{label} attention B={batch} ctx={context}", repeats, numpy_backend, metal,
                                 make, rng))
    for label, in_features, out_features in LINEARS:
        for tokens in (1, 16):
            make = functools.partial(linear_case, tokens=tokens, in_features=in_features, out_features=out_features)
            rows.append(_row(f"{label} linear T={tokens}", repeats, numpy_backend, metal, make, rng))
    print(format_table(("op and shape", "numpy f32", "metal f32", "metal bf16", "metal f32 speed vs numpy"), rows))


def _row(shape, repeats, numpy_backend, metal, make, rng):
    numpy_ms = timed(numpy_backend, make(numpy_backend, "float32", rng), repeats)
    metal_ms = timed(metal, make(metal, "float32", rng), repeats)
    metal_bf16_ms = timed(metal, make(metal, "bfloat16", rng), repeats)
    return (shape, f"{numpy_ms:.3f}", f"{metal_ms:.3f}", f"{metal_bf16_ms:.3f}", f"{numpy_ms / metal_ms:.2f}x")


if __name__ == "__main__":
    main()
