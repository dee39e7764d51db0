"""Offline generation throughput at growing concurrency, on one backend.

    python bench/offline_throughput.py [--backend cpu] [--model PATH] [--concurrency 1 4 16 64]
                                       [--prompt-tokens 64] [--output-tokens 64]
                                       [--load-format auto|dummy] [--dummy-quantization FORMAT]
                                       [--device-ids 0,1] [--dtype DTYPE]

Each row runs `concurrency` requests at once (random prompts of --prompt-tokens, greedy, exactly
--output-tokens each) and reports output tokens per second over the whole run, the mean time per
output token of a request after its first, and the speed-up over one request at a time measured
in the same run. The model defaults to the default model (Qwen2.5-Coder-0.5B-Instruct, GGUF);
`--model bench/configs/llama-3-8b --load-format dummy` runs Llama-3-8B's shapes on random weights.
`--device-ids 0,1` runs the model tensor-parallel over those devices (on a CPU with torch, ranks that
share the cores): run it once with `--device-ids 0` and once with `0,1` to compare.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from candelabra.core.contract.device import Device
from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table
from candelabra.core.worker.topology import Topology


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
    parser.add_argument("--device-ids", default="0", help="one device, or several for tensor parallelism (0,1)")
    parser.add_argument("--dtype", help="compute dtype (default: the backend's)")
    args = parser.parse_args()

    topology = Topology(Device.parse_ids(args.device_ids) or (0,), master_port=29531)
    llm = LLM(args.model, backend=args.backend, topology=topology, dtype=args.dtype, load_format=args.load_format,
              dummy_quantization=args.dummy_quantization, kvcache_mem_gpu=args.kvcache_mem, kvcache_mem_cpu=0,
              max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096, prefill_chunk_size=512)
    rng = np.random.default_rng(0)
    run(llm, 1, 8, 4, rng)  # warm-up
    rows, baseline = [], None
    for concurrency in args.concurrency:
        throughput, per_token = run(llm, concurrency, args.prompt_tokens, args.output_tokens, rng)
        baseline = baseline or throughput
        rows.append((concurrency, f"{throughput:.1f}", f"{per_token * 1e3:.1f}", f"{throughput / baseline:.2f}x"))
    llm.close()
    print(f"{llm.model.config.architecture} on {llm.backend.name} ({llm.backend.probe().detail}), "
          f"{topology.world_size} rank(s) on devices {args.device_ids}, {llm.model.dtype}, "
          f"{args.prompt_tokens} prompt and {args.output_tokens} output tokens per request, greedy")
    print(format_table(("concurrent requests", "output tokens/s", "ms per output token", "vs 1 request"), rows))


if __name__ == "__main__":
    main()
