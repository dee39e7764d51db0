"""A quantized KV cache against a 16-bit one, in one run: bytes per token, how many sequences of a given
length fit in a fixed budget of cache memory, and decode tokens/s with 64 sequences at once.

    python bench/kv_cache_quant.py [--model bench/configs/qwen2.5-0.5b] [--backend torch] [--dtype DTYPE]
                                   [--kv-dtypes bfloat16 int8] [--budget-gib 4] [--seq-len 4096]
                                   [--concurrency 64] [--prompt-tokens 64] [--output-tokens 32]

The model runs on random weights in the shapes of --model's config.json (default: Qwen2.5-0.5B's). Each
cache dtype gets its own engine over the same model shapes; decode tokens/s counts the tokens after every
request has its first one (all prompts prefilled), so it measures decode steps of --concurrency sequences
only. The compute dtype is the backend's default unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table
from candelabra.core.worker.kv_cache_size import one_block

DEFAULT_MODEL = Path(__file__).parent / "configs" / "qwen2.5-0.5b"


def cpu_name() -> str:
    """lscpu's model name (the machine's CPU), else what Python knows of it."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.machine()


def decode_tokens_per_second(llm: LLM, concurrency: int, prompt_tokens: int, output_tokens: int) -> float:
    """Tokens per second over the steps after every request has its first token."""
    engine, rng = llm.engine, np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"kv-bench-{i}", rng.integers(100, vocab - 100, prompt_tokens).tolist(), params)
    started, decode_start, decoded = set(), None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if decode_start is not None:
            decoded += len(outputs)
        started.update(output.request_id for output in outputs)
        if decode_start is None and len(started) == concurrency:
            decode_start = time.perf_counter()
    return decoded / (time.perf_counter() - decode_start)


def measure(args: argparse.Namespace, kv_dtype: str) -> tuple[str, ...]:
    llm = LLM(str(args.model), backend=args.backend, dtype=args.dtype, kv_cache_dtype=kv_dtype, load_format="dummy",
              kvcache_mem_gpu=args.cache_mb, kvcache_mem_cpu=0, max_num_seqs=args.concurrency,
              max_num_batched_tokens=args.concurrency * args.prompt_tokens,
              max_model_len=args.prompt_tokens + args.output_tokens)
    try:
        block = one_block(llm.model, llm.engine.config.block_size, kv_dtype)
        blocks_per_sequence = -(-args.seq_len // block.block_size)
        fit = int(args.budget_gib * 2**30) // block.bytes_per_block // blocks_per_sequence
        decode_tokens_per_second(llm, 1, 8, 4)  # warm-up
        speed = decode_tokens_per_second(llm, args.concurrency, args.prompt_tokens, args.output_tokens)
        return (kv_dtype, llm.model.dtype, f"{block.bytes_per_token:,}", f"{fit:,}", f"{speed:.1f}")
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a folder with a config.json")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", help="compute dtype (default: the backend's)")
    parser.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "int8"], help="the cache dtypes compared")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="cache memory for the sequences-that-fit column")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence for that column")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--cache-mb", type=float, default=512, help="KV cache of the decode runs, MB")
    args = parser.parse_args(argv)
    rows = [measure(args, kv_dtype) for kv_dtype in args.kv_dtypes]
    print(f"{args.model.name} (random weights) on {args.backend}, CPU: {cpu_name()}; decode: {args.concurrency} "
          f"sequences of {args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens each, greedy")
    print(format_table(("KV cache", "compute", "KV bytes/token", f"sequences of {args.seq_len} in {args.budget_gib:g} "
                        "GiB", f"decode tokens/s at {args.concurrency}"), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
