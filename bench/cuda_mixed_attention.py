"""Paged attention on a GPU in a step that mixes decodes with a prefill chunk: the decodes tiled apart
(two launches, what the cuda backend does) against every sequence in prefill tiles (one launch).

    python bench/cuda_mixed_attention.py [--decodes 1 15 63] [--chunk 512] [--context 4096]
                                         [--heads 32 8] [--head-dim 128] [--dtype bfloat16]

Each step holds one prefill chunk of --chunk tokens and --decodes sequences of one token, every
sequence --context tokens long, in Llama-3-8B's attention shapes by default, over a random bfloat16 cache.
Both ways run the same kernel on the same inputs and must agree; the time is the GPU's a call
(cuda_profile.median_ms: calls queued behind a busy GPU, timed with CUDA events).
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch
from attention_shapes import add_attention_shape, parse_on_gpu  # bench/, beside this script
from cuda_profile import median_ms

from candelabra.backends.cuda.kernels.paged_attention import paged_attention
from candelabra.backends.cuda.step import CudaStep
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.text_table import format_table

BLOCK_SIZE = 16


def mixed_step(decodes: int, chunk: int, context: int) -> StepMetadata:
    query_lens = [chunk] + [1] * decodes
    blocks = -(-context // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(query_lens))]
    return StepMetadata.build(query_lens, [context] * len(query_lens), tables, BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[1, 15, 63])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=4096)
    add_attention_shape(parser)
    args = parse_on_gpu(parser)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads = args.heads
    generator = torch.Generator("cuda").manual_seed(0)
    rows = []
    for decodes in args.decodes:
        meta = mixed_step(decodes, args.chunk, args.context)
        step = CudaStep.prepare(meta, torch.device("cuda"))
        one_launch = dataclasses.replace(step, decode_tokens=None)
        blocks = int(meta.block_tables.max()) + 1
        key_cache = torch.randn(blocks, BLOCK_SIZE, kv_heads, args.head_dim, device="cuda", dtype=dtype,
                                generator=generator)
        value_cache = torch.randn_like(key_cache)
        q = torch.randn(step.num_tokens, heads, args.head_dim, device="cuda", dtype=dtype, generator=generator)
        scale = args.head_dim ** -0.5
        apart = paged_attention(q, key_cache, value_cache, step, scale)
        together = paged_attention(q, key_cache, value_cache, one_launch, scale)
        difference = (apart.float() - together.float()).abs().max().item()
        apart_ms = median_ms(partial(paged_attention, q, key_cache, value_cache, step, scale))
        together_ms = median_ms(partial(paged_attention, q, key_cache, value_cache, one_launch, scale))
        rows.append((decodes, f"{apart_ms:.3f}", f"{together_ms:.3f}", f"{difference:.1e}"))
    print(f"{torch.cuda.get_device_name()}: one {args.chunk}-token prefill chunk beside N decodes, "
          f"{args.context} tokens of context each, {heads}/{kv_heads} heads of {args.head_dim}, {args.dtype}")
    print(format_table(("decodes", "decodes apart ms", "one launch ms", "max difference"), rows))


if __name__ == "__main__":
    main()
