"""Decode speed with steps in turn against steps scheduled ahead (--async-scheduling), alternated in one run.

    python bench/scheduled_ahead.py [--backend metal] [--config bench/configs/qwen2.5-0.5b | --model PATH]
                                    [--dtype bfloat16] [--batches 1 16] [--prompt-tokens 64]
                                    [--output-tokens 32] [--rounds 3] [--json FILE]

Scheduling ahead hides the host's work for a step (scheduling, the step's inputs, the graph's building,
detokenizing) behind the device's work on the step before, where the device runs apart from the host:
a GPU, or MLX, whose evaluation runs on threads of its own even in its CPU build. On a backend that
computes as it is called (numpy, torch on a CPU) it cannot gain, and costs the one step a finished
request computes for nothing. Two engines over one model, one each way, each with its own cache; each
batch is timed --rounds times each way, alternating, and the best of each kept. The table gives decode
tokens/s (from the step after every prefill to the end) both ways and their ratio; the CPU's name heads
it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from candelabra.core.engine.engine import EngineConfig, LLMEngine
from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table
from candelabra.core.worker.model_runner import ModelRunner

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "qwen2.5-0.5b"


def decode_speed(engine: LLMEngine, batch: int, prompt_tokens: int, output_tokens: int, vocab: int, rng) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}-{rng.integers(1 << 30)}", rng.integers(0, vocab, prompt_tokens).tolist(),
                           params)
    started = set()
    while len(started) < batch:  # prefills, until every request has its first token
        started |= {output.request_id for output in engine.step() if output.outputs[0].token_ids}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * (output_tokens - 1) / (time.perf_counter() - start)


def engine_of(llm: LLM, async_scheduling: bool, max_num_seqs: int) -> LLMEngine:
    """Another engine over `llm`'s model, with a cache of its own as large as `llm`'s."""
    spec = llm.engine.core.runner.kv_spec
    config = EngineConfig(block_size=spec.block_size, num_blocks=spec.num_blocks, max_num_seqs=max_num_seqs,
                          async_scheduling=async_scheduling)
    runner = ModelRunner(llm.model, spec.num_blocks, spec.block_size)
    return LLMEngine(runner, llm.tokenizer, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="metal")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="a folder with a config.json, loaded with random weights (default: Qwen2.5-0.5B's)")
    parser.add_argument("--model", help="a checkpoint to load instead of --config")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-mb", type=float, default=512)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.rounds < 1 or args.output_tokens < 2 or min(args.batches) < 1:
        parser.error("--rounds and --batches must be at least 1, --output-tokens at least 2")

    from candelabra.backends.torch.cpu.features import cpu_flags, cpu_model_name

    source = dict(model=args.model) if args.model else dict(model=str(args.config), load_format="dummy")
    llm = LLM(**source, backend=args.backend, dtype=args.dtype, kvcache_mem_gpu=args.kv_cache_mb, kvcache_mem_cpu=0,
              max_num_seqs=max(args.batches))
    engines = {False: llm.engine, True: engine_of(llm, True, max(args.batches))}
    vocab, rng = llm.model.config.vocab_size, np.random.default_rng(0)
    decode_speed(engines[False], 1, 8, 4, vocab, rng)  # warm-up: compiles, first allocations
    decode_speed(engines[True], 1, 8, 4, vocab, rng)
    best: dict[tuple[int, bool], float] = {}
    for batch in args.batches:
        for _ in range(args.rounds):
            for ahead in (False, True):
                speed = decode_speed(engines[ahead], batch, args.prompt_tokens, args.output_tokens, vocab, rng)
                best[(batch, ahead)] = max(best.get((batch, ahead), 0.0), speed)
    amx = "AMX" if "amx_tile" in cpu_flags() else "no AMX"
    print(f"{cpu_model_name()} ({amx}); backend {args.backend} ({llm.backend.probe().detail}); "
          f"{args.model or args.config.name} in {llm.model.dtype}; {args.prompt_tokens} tokens in, "
          f"{args.output_tokens} out; best of {args.rounds} alternated rounds")
    rows = [(batch, f"{best[(batch, False)]:.1f}", f"{best[(batch, True)]:.1f}",
             f"{best[(batch, True)] / best[(batch, False)]:.2f}x") for batch in args.batches]
    print(format_table(("batch", "in turn tok/s", "ahead tok/s", "ahead / in turn"), rows))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model_name(), "backend": args.backend,
                                         "tok_s": {f"{batch}-{'ahead' if ahead else 'in-turn'}": speed
                                                   for (batch, ahead), speed in best.items()}}, indent=2))


if __name__ == "__main__":
    main()
