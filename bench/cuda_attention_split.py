"""Decode attention on a GPU with each sequence's keys split into segments of at least N steps, for a few N:
where splitting starts to pay, which kernels/key_segments.py's MIN_SEGMENT_STEPS should say.

    python bench/cuda_attention_split.py [--batches 1 4] [--contexts 128 512 ...] [--min-steps 1 2 4 8 16 0]
                                         [--layers 32] [--heads 32 8] [--head-dim 128] [--dtype bfloat16]

A decode step of --batches sequences, every one --contexts tokens long, in Llama-3-8B's attention shapes by
default, over --layers caches of random keys and values read in turn (as a step's layers read theirs, so
that L2 holds none of them). --min-steps 0 stands for no split at all. Every way must agree with the
unsplit one; the time is the GPU's a call (cuda_profile.median_ms: calls queued behind a busy GPU, timed
with CUDA events).
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
from attention_shapes import add_attention_shape, parse_on_gpu  # bench/, beside this script
from cuda_profile import median_ms

from candelabra.backends.cuda.kernels.key_segments import segments_of_at_least
from candelabra.backends.cuda.kernels.paged_attention import paged_attention
from candelabra.backends.cuda.step import CudaStep
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.text_table import format_table

BLOCK_SIZE = 16
NEVER = 1 << 30  # steps a segment: more than any context has


def decode_step(batch: int, context: int) -> StepMetadata:
    blocks = -(-context // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    return StepMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE)


def attend_in_turn(q: torch.Tensor, caches, step: CudaStep, scale: float) -> torch.Tensor:
    """Attention over the next of `caches` (an endless iterator of key and value caches)."""
    return paged_attention(q, *next(caches), step, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--min-steps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 0])
    parser.add_argument("--layers", type=int, default=32)
    add_attention_shape(parser)
    args = parse_on_gpu(parser)
    if any(steps < 0 for steps in args.min_steps):
        parser.error("--min-steps are whole numbers of steps, 0 for no split")
    dtype, (heads, kv_heads), generator = getattr(torch, args.dtype), args.heads, torch.Generator("cuda")
    generator.manual_seed(0)
    scale = args.head_dim ** -0.5
    rows = []
    for batch, context in itertools.product(args.batches, args.contexts):
        meta = decode_step(batch, context)
        step = CudaStep.prepare(meta, torch.device("cuda"))
        blocks = int(meta.block_tables.max()) + 1
        caches = [(torch.randn(blocks, BLOCK_SIZE, kv_heads, args.head_dim, device="cuda", dtype=dtype,
                               generator=generator),
                   torch.randn(blocks, BLOCK_SIZE, kv_heads, args.head_dim, device="cuda", dtype=dtype,
                               generator=generator)) for _ in range(args.layers)]
        q = torch.randn(batch, heads, args.head_dim, device="cuda", dtype=dtype, generator=generator)
        with segments_of_at_least(NEVER):
            whole = paged_attention(q, *caches[0], step, scale).float()
        attend = partial(attend_in_turn, q, itertools.cycle(caches), step, scale)
        times, worst = [], 0.0
        for steps in args.min_steps:
            with segments_of_at_least(steps or NEVER):
                worst = max(worst, (paged_attention(q, *caches[0], step, scale).float() - whole).abs().max().item())
                times.append(median_ms(attend) * 1000)
        best = min(range(len(times)), key=times.__getitem__)
        rows.append((batch, context, *(f"{t:.1f}" for t in times), args.min_steps[best] or "no split",
                     f"{worst:.1e}"))
        del caches
    print(f"{torch.cuda.get_device_name()}: decode attention, {heads}/{kv_heads} heads of {args.head_dim}, "
          f"{args.dtype}, {args.layers} caches in turn; µs a call with segments of at least N steps of keys")
    header = ("batch", "context", *(f"N={steps}" if steps else "no split" for steps in args.min_steps), "fastest",
              "max difference")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
