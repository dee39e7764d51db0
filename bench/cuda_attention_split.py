"""Decode attention on a GPU two ways: with each sequence's keys split into segments of at least N steps, for a
few N (where splitting starts to pay, which kernels/key_segments.py's MIN_SEGMENT_STEPS should say), and with
the decode tile stepping through K keys at a time in S stages, for a few K x S (which choose_tiling should
give a decode).

    python bench/cuda_attention_split.py [--batches 1 4] [--contexts 128 512 ...] [--min-steps 1 2 4 8 16 0]
                                         [--tiling-batches 1 16 64] [--tiling-contexts 128 1024 4096]
                                         [--tilings 64x3 64x2 32x3 32x2] [--layers 32]
                                         [--heads 32 8] [--head-dim 128] [--dtype bfloat16]

A decode step of B sequences, every one C tokens long, in Llama-3-8B's attention shapes by default, over
--layers caches of random keys and values read in turn (as a step's layers read theirs, so that L2 holds
none of them). --min-steps 0 stands for no split at all. Every way must agree with the unsplit one in the
tiling choose_tiling gives; the time is the GPU's a call (cuda_profile.median_ms: calls queued behind a busy
GPU, timed with CUDA events).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable
from functools import partial

import torch
from attention_shapes import add_attention_shape, parse_on_gpu  # bench/, beside this script
from cuda_profile import median_ms

from candelabra.backends.cuda.kernels.key_segments import segments_of_at_least
from candelabra.backends.cuda.kernels.paged_attention import decode_tiles, paged_attention
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


def time_ways(args, batch: int, context: int, ways: list[Callable[[], contextlib.AbstractContextManager]],
              generator) -> tuple[list[float], float]:
    """µs a call under each of `ways` (a context manager each), and the largest difference of their outputs
    from the unsplit one's."""
    dtype, (heads, kv_heads), scale = getattr(torch, args.dtype), args.heads, args.head_dim ** -0.5
    meta = decode_step(batch, context)
    step = CudaStep.prepare(meta, torch.device("cuda"))
    shape = (int(meta.block_tables.max()) + 1, BLOCK_SIZE, kv_heads, args.head_dim)
    caches = [(torch.randn(shape, device="cuda", dtype=dtype, generator=generator),
               torch.randn(shape, device="cuda", dtype=dtype, generator=generator)) for _ in range(args.layers)]
    q = torch.randn(batch, heads, args.head_dim, device="cuda", dtype=dtype, generator=generator)
    with segments_of_at_least(NEVER):
        whole = paged_attention(q, *caches[0], step, scale).float()
    attend = partial(attend_in_turn, q, itertools.cycle(caches), step, scale)
    times, worst = [], 0.0
    for way in ways:
        with way():
            worst = max(worst, (paged_attention(q, *caches[0], step, scale).float() - whole).abs().max().item())
            times.append(median_ms(attend) * 1000)
    return times, worst


def table(args, batches: list[int], contexts: list[int], ways: dict[str, Callable], generator) -> str:
    rows = []
    for batch, context in itertools.product(batches, contexts):
        times, worst = time_ways(args, batch, context, list(ways.values()), generator)
        fastest = list(ways)[min(range(len(times)), key=times.__getitem__)]
        rows.append((batch, context, *(f"{t:.1f}" for t in times), fastest, f"{worst:.1e}"))
    return format_table(("batch", "context", *ways, "fastest", "max difference"), rows)


def tiling(text: str) -> tuple[int, int]:
    keys, _, stages = text.partition("x")
    try:
        return int(keys), int(stages)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tiling is KEYSxSTAGES, as 64x3; not {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--min-steps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 0])
    parser.add_argument("--tiling-batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--tiling-contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--tilings", type=tiling, nargs="+", default=[(64, 3), (64, 2), (32, 3), (32, 2)])
    parser.add_argument("--layers", type=int, default=32)
    add_attention_shape(parser)
    args = parse_on_gpu(parser)
    if any(steps < 0 for steps in args.min_steps):
        parser.error("--min-steps are whole numbers of steps, 0 for no split")
    for keys, stages in args.tilings:
        try:
            with decode_tiles(keys, stages):
                pass
        except ValueError as refused:
            parser.error(str(refused))
    generator = torch.Generator("cuda")
    generator.manual_seed(0)
    shape = (f"{torch.cuda.get_device_name()}: decode attention, {args.heads[0]}/{args.heads[1]} heads of "
             f"{args.head_dim}, {args.dtype}, {args.layers} caches in turn; µs a call")
    splits = {(f"N={steps}" if steps else "no split"): partial(segments_of_at_least, steps or NEVER)
              for steps in args.min_steps}
    print(f"{shape}, keys split into segments of at least N steps")
    print(table(args, args.batches, args.contexts, splits, generator))
    if args.tiling_batches:
        tiles = {f"{keys}x{stages}": partial(decode_tiles, keys, stages) for keys, stages in args.tilings}
        print(f"\n{shape}, the decode tile stepping through K keys in S stages (KxS), split as the backend splits")
        print(table(args, args.tiling_batches, args.tiling_contexts, tiles, generator))


if __name__ == "__main__":
    main()
