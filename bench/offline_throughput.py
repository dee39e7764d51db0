"""Offline generation throughput at growing concurrency, on one backend.

    python bench/offline_throughput.py [--backend cpu] [--model PATH] [--concurrency 1 4 16 64]
                                       [--prompt-tokens 64] [--output-tokens 64]
                                       [--load-format auto|dummy] [--dummy-quantization FORMAT]

Each row runs `concurrency` requests at once (random prompts of --prompt-tokens, greedy, exactly
--output-tokens each) and reports output tokens per second over the whole run, the mean time per
output token of a request after its first, and the speed-up over one request at a time measured
in the same run. The model defaults to the default model (Qwen2.5-Coder-0.5B-Instruct, GGUF);
`--model bench/configs/llama-3-8b --load-format dummy` runs Llama-3-8B's shapes on random weights.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from candelabra.core.engine.sampling_params import SamplingParams
from candelabra.core.llm import LLM
from candelabra.core.text_table import format_table


def run(llm: LLM, concurrency: int, prompt_tokens: int, output_tokens: int, rng) -> tuple[float, float]:
    engine = llm.engine
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"bench-{concurrency}-{i}", rng.integers(100, vocab - 100, prompt_tokens).tolist(), params)
    start, first_token, finish = time.perf_counter(), {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            first_token.setdefault(output.request_id, now)
            if output.finished:
                finish[output.request_id] = now
    elapsed = time.perf_counter() - start
    per_token = [(finish[r] - first_token[r]) / (output_tokens - 1) for r in finish] if output_tokens > 1 else [0]
    return concurrency * output_tokens / elapsed, float(np.mean(per_token))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kvcache-mem", type=float, default=2048, help="MB of KV cache")
    parser.add_argument("--load-format", default="auto",
                        help="auto: the checkpoint's weights; dummy: random ones shaped by --model's config.json")
    parser.add_argument("--dummy-quantization", metavar="FORMAT", help="with dummy: linear weights in this GGUF format")
    args = parser.parse_args()

    llm = LLM(args.model, backend=args.backend, load_format=args.load_format,
              dummy_quantization=args.dummy_quantization, kvcache_mem_gpu=args.kvcache_mem, kvcache_mem_cpu=0,
              max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096, prefill_chunk_size=512)
    rng = np.random.default_rng(0)
    run(llm, 1, 8, 4, rng)  # warm-up
    rows, baseline = [], None
    for concurrency in args.concurrency:
        throughput, per_token = run(llm, concurrency, args.prompt_tokens, args.output_tokens, rng)
        baseline = baseline or throughput
        rows.append((concurrency, f"{throughput:.1f}", f"{per_token * 1e3:.1f}", f"{throughput / baseline:.2f}x"))
    print(f"{llm.model.config.architecture} on {llm.backend.name} ({llm.backend.probe().device}), "
          f"{args.prompt_tokens} prompt and {args.output_tokens} output tokens per request, greedy")
    print(format_table(("concurrent requests", "output tokens/s", "ms per output token", "vs 1 request"), rows))


if __name__ == "__main__":
    main()
