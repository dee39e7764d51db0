"""Decode speed of the cuda backend on one GPU, against the memory roofline and transformers.

    python bench/cuda_decode.py [--config bench/configs/llama-3-8b] [--batches 1 16 64]
                                [--output-tokens 128] [--prompt-tokens 128] [--ttft-prompt 2048]
                                [--parts bfloat16 int4 transformers] [--int4-formats Q4_K INT4_G128]
                                [--no-async-scheduling] [--repeats 3] [--json FILE]

One run, one GPU, everything measured in it (--parts picks some of it, for runs of a few minutes each:
bench/gpu_check.sh's bench steps; int4 alone still measures bfloat16 at batch 1 to compare with):
- the device-to-device copy bandwidth (a 2 GiB copy, read plus write), and from it the roofline of
  a decode step: the bytes of weights it reads (every weight but the embedding table) over that
  bandwidth, so batch B decodes at most B * bandwidth / bytes tokens a second;
- candelabra, `--load-format dummy` weights in bfloat16 in the config's shapes: decode tokens/s at
  each batch (requests of --prompt-tokens random ids, --output-tokens each, timed from the step
  after every prefill to the end; the median of --repeats runs, beside their spread), and the time to
  first token of one --ttft-prompt-token prompt;
- the same with the linear weights as random Q4_K blocks (int4 on the GPU) at batch 1, and with
  --int4-formats INT4_G128 as GPTQ's and AWQ's usual groups of 128 load (one scale a group);
- transformers' `generate` on the same GPU and batches, random weights from the same config in
  bfloat16, greedy: its decode tokens/s from two generate calls of different lengths.
Then the goals of the cuda backend: batch 1 at >= 85% of the roofline, batch 64 >= 10x
transformers, int4 batch 1 >= 1.6x bfloat16 batch 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from candelabra.core.contract.weights import INT4_GROUP_FORMATS
from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3-8b"
PARTS = ("bfloat16", "int4", "transformers")


def copy_bandwidth(torch, gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes a second a device-to-device copy moves, counting what it reads and what it writes."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / repeats
    del source, target
    return 2 * gib * 2**30 / seconds


def weight_bytes_read_per_step(model) -> int:
    """The bytes of every weight a decode step reads: all uploaded tensors and packed weights of the
    model but the embedding table, of which a step reads only its tokens' rows."""
    import torch

    seen, total = {id(model.embed_tokens)}, 0
    if model.lm_head is model.embed_tokens:  # a tied LM head reads the whole table
        seen.discard(id(model.embed_tokens))
    stack = [model.lm_head, model.final_norm, *model.layers]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif hasattr(item, "nbytes") and hasattr(item, "matmul"):
            total += int(item.nbytes)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return total


def decode_speed(llm: LLM, batch: int, prompt_tokens: int, output_tokens: int, rng) -> float:
    """Output tokens a second once every request is decoding."""
    engine, vocab = llm.engine, llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}-{rng.integers(1 << 30)}",
                           rng.integers(0, vocab, prompt_tokens).tolist(), params)
    produced = 0
    while produced < batch:  # prefills, until every request has its first token
        produced += sum(1 for output in engine.step() if len(output.outputs[0].token_ids) == 1)
    llm.backend.synchronize()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    llm.backend.synchronize()
    return batch * (output_tokens - 1) / (time.perf_counter() - start)


def spread(runs: list[float]) -> str:
    """How far apart `runs` are: (slowest to fastest) over their median."""
    return f"{(max(runs) - min(runs)) / statistics.median(runs):.1%}"


def time_to_first_token(llm: LLM, prompt_tokens: int, rng) -> float:
    engine, vocab = llm.engine, llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    best = float("inf")
    for attempt in range(3):  # the first compiles the prefill kernels
        engine.add_request(f"ttft-{attempt}-{rng.integers(1 << 30)}", rng.integers(0, vocab, prompt_tokens).tolist(),
                           params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        best = min(best, time.perf_counter() - start)
    return best


def candelabra_run(args, quantization: str | None, batches: list[int], rng, ttft: bool = False) -> dict:
    import torch

    llm = LLM(str(args.config), backend="cuda", dtype="bfloat16", load_format="dummy",
              dummy_quantization=quantization, kvcache_mem_gpu=args.kv_cache_mb, kvcache_mem_cpu=0,
              max_num_seqs=max(batches), max_num_batched_tokens=max(4096, args.ttft_prompt),
              prefill_chunk_size=max(2048, args.ttft_prompt), async_scheduling=args.async_scheduling)
    result = {"weight_bytes": weight_bytes_read_per_step(llm.model),
              "async_scheduling": llm.engine.core.config.async_scheduling}
    decode_speed(llm, 1, 16, 8, rng)  # warm-up: kernel compilation, the batch-1 graph
    result["decode_runs"] = {batch: [decode_speed(llm, batch, args.prompt_tokens, args.output_tokens, rng)
                                     for _ in range(args.repeats)] for batch in batches}
    result["decode"] = {batch: statistics.median(runs) for batch, runs in result["decode_runs"].items()}
    if ttft:
        result["ttft"] = time_to_first_token(llm, args.ttft_prompt, rng)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def transformers_speed(args, batches: list[int], rng) -> dict[int, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    speeds = {}
    for batch in batches:
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (batch, args.prompt_tokens))).cuda()

        generate_seconds(model, ids, 4)  # warm-up
        short, long = generate_seconds(model, ids, 1), generate_seconds(model, ids, args.output_tokens)
        speeds[batch] = batch * (args.output_tokens - 1) / (long - short)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return speeds


def generate_seconds(model, ids, new_tokens: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a folder with a config.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt", type=int, default=2048, help="prompt tokens of the time-to-first-token run")
    parser.add_argument("--kv-cache-mb", type=float, default=16384)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to measure (default: all of it)")
    parser.add_argument("--int4-formats", nargs="+", default=["Q4_K"], choices=["Q4_K", *INT4_GROUP_FORMATS],
                        help="the int4 part's weight formats, each at batch 1 (default: Q4_K, the goal's)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="candelabra schedules each step before the one running has returned its tokens "
                             "(default: the engine's, on for cuda)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="decode runs a batch size, of which the median is reported beside their spread "
                             "(two settings a couple of percent apart are told apart only beyond it)")
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats takes 1 or more, not {args.repeats}")
    # the engine's start-up lines (the graphs' capture, the GEMV's tilings measured), as a server logs them
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_decode.py needs a CUDA device; torch sees none")
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(torch)
    bf16 = None
    if "bfloat16" in args.parts or "int4" in args.parts:
        bf16 = candelabra_run(args, None, args.batches if "bfloat16" in args.parts else [1], rng,
                              ttft="bfloat16" in args.parts)
    int4s = {fmt: candelabra_run(args, fmt, [1], rng) for fmt in args.int4_formats} if "int4" in args.parts else {}
    reference = transformers_speed(args, args.batches, rng) if "transformers" in args.parts else {}

    ahead = bf16["async_scheduling"] if bf16 else None
    mode = {True: "; candelabra's steps scheduled ahead", False: "; candelabra's steps in turn (--no-async-scheduling)",
            None: ""}[ahead]
    if bf16 or int4s:
        from candelabra.backends.cuda.kernels.dependent_launch import SWITCH, dependent

        launches = ("dependent launches" if dependent(torch.device("cuda"))
                    else f"no dependent launches ({SWITCH}=0, or a GPU before Hopper)")
        mode += f"; {launches}"
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.config.name}; "
          f"{args.prompt_tokens} tokens in, {args.output_tokens} out{mode}")
    if bf16:
        print(f"in bfloat16 a decode step reads {bf16['weight_bytes'] / 1e9:.2f} GB of weights")
    rows = []
    for batch in args.batches:
        ours = bf16["decode"].get(batch) if bf16 else None
        runs = bf16["decode_runs"].get(batch) if bf16 else None
        roofline = batch * bandwidth / bf16["weight_bytes"] if bf16 else None
        theirs = reference.get(batch)
        rows.append((batch, f"{ours:.1f}" if ours else "-", spread(runs) if runs else "-",
                     f"{roofline:.1f}" if roofline else "-", f"{ours / roofline:.0%}" if ours else "-",
                     f"{theirs:.1f}" if theirs else "-", f"{ours / theirs:.1f}x" if ours and theirs else "-"))
    print(format_table(("batch", "candelabra tok/s", "spread", "roofline tok/s", "of roofline", "transformers tok/s",
                        "candelabra/transformers"), rows))
    if bf16 and "ttft" in bf16:
        print(f"time to first token, {args.ttft_prompt}-token prompt: {bf16['ttft'] * 1e3:.0f} ms")
    for fmt, int4 in int4s.items():
        ratio = int4["decode"][1] / bf16["decode"][1]
        print(f"int4 ({fmt}) batch 1: {int4['decode'][1]:.1f} tok/s (spread {spread(int4['decode_runs'][1])}), "
              f"{int4['weight_bytes'] / 1e9:.2f} GB a step; {ratio:.2f}x bfloat16 (goal 1.6x)")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
                                         "config": args.config.name, "bfloat16": bf16,
                                         "int4": int4s.get("Q4_K"), "int4_by_format": int4s,
                                         "transformers": reference, "async_scheduling": ahead},
                                        indent=2))


if __name__ == "__main__":
    main()
