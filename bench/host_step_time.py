"""The host's share of a decode step: what the engine does around the model, phase by phase.

    python bench/host_step_time.py [--backend torch] [--model PATH] [--concurrency 1 16 64]
                                   [--prompt-tokens 256] [--temperature 0] [--steps 60]
                                   [--kv-cache-mb 1024]

On a GPU the host's work between two steps leaves the GPU idle unless it is hidden, so every
millisecond here is a millisecond of each decode step there (bench/cuda_profile.py measures the same
gap on a GPU, under the profiler). Without --model a tiny random checkpoint is written to a temporary
folder: the host's work depends on the batch, the sequences' lengths and the vocabulary, hardly on the
model, and a tiny model keeps the device work small beside it.

For each concurrency, that many requests of random --prompt-tokens ids are prefilled, then --steps
decode steps are timed, each phase by wrapping the engine's own methods:
    schedule        the scheduler picks the batch and grows the block tables
    inputs          the runner lays out the step's tokens, metadata and sampling rows (numpy)
    run             the backend's step executor: the model and sampling (on an eager backend the
                    ops themselves; on a GPU their launches, or a graph's replay)
    fetch           the sampled tokens back on the host (on a GPU, the wait for the step to end)
    update          the scheduler takes the tokens, finishes sequences
    outputs         the core's per-request outputs
    text            detokenizing and stop strings (LLMEngine.step around the core's step)
and the host's total: the whole step less `run` and `fetch` (on a GPU, what the device waits for
between steps, which asynchronous scheduling would hide), and the longest step (a stall: a full garbage
collection took 110 to 140 ms before LLM froze the loaded objects out of them).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table

PHASES = ("schedule", "inputs", "run", "fetch", "update", "outputs", "text")


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def timed_engine(llm: LLM) -> PhaseTimer:
    timer = PhaseTimer()
    core = llm.engine.core
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.runner, "order", "inputs")
    timer.wrap(core.runner.executor, "run", "run")
    timed_fetch(timer, core.runner.backend)
    timer.wrap(core.scheduler, "update_from_output", "update")
    timer.wrap(core, "_outputs", "outputs")
    timer.wrap(core, "step", "core")
    return timer


def timed_fetch(timer: PhaseTimer, backend) -> None:
    """The wait in each step's fetch, begun by `start_fetch` and finished by the function it returns."""
    start_fetch = backend.start_fetch

    def started(*tensors):
        finish = start_fetch(*tensors)

        def waited():
            start = time.perf_counter()
            try:
                return finish()
            finally:
                timer.seconds["fetch"] += time.perf_counter() - start

        return waited

    backend.start_fetch = started


def measure(llm: LLM, timer: PhaseTimer, concurrency: int, args, rng) -> list[str]:
    engine = llm.engine
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 16, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"host-{concurrency}-{i}", rng.integers(0, vocab, args.prompt_tokens).tolist(), params)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(not seq.num_output_tokens for seq in scheduler.running):
        engine.step()
    for _ in range(4):  # past the first decode steps (graphs, compiles)
        engine.step()
    timer.seconds.clear()
    start = worst = time.perf_counter()
    longest = 0.0
    for _ in range(args.steps):
        engine.step()
        longest, worst = max(longest, time.perf_counter() - worst), time.perf_counter()
    whole = (time.perf_counter() - start) / args.steps
    per_step = {phase: seconds / args.steps for phase, seconds in timer.seconds.items()}
    while engine.has_unfinished_requests():
        engine.step()
    per_step["text"] = whole - per_step.pop("core")
    host = whole - per_step["run"] - per_step.get("fetch", 0.0)
    return [str(concurrency), *(f"{per_step.get(phase, 0) * 1e3:.3f}" for phase in PHASES),
            f"{host * 1e3:.3f}", f"{whole * 1e3:.3f}", f"{longest * 1e3:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: a tiny random one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=60, help="decode steps timed per row (default: %(default)s)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="candelabra-host-step-") as folder:
        model = args.model
        if model is None:
            from candelabra.conformance.engine_cases import write_tiny_checkpoint

            write_tiny_checkpoint(Path(folder), seed=0)
            config = json.loads((Path(folder) / "config.json").read_text())
            # room for long prompts: a sequence's block table grows with it, and so may the host's work
            config["max_position_embeddings"] = max(config["max_position_embeddings"],
                                                    args.prompt_tokens + args.steps + 64)
            (Path(folder) / "config.json").write_text(json.dumps(config))
            model = folder
        llm = LLM(model, backend=args.backend, kvcache_mem_gpu=args.kv_cache_mb, kvcache_mem_cpu=0,
                  max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192, prefill_chunk_size=2048)
        if llm.model.config.max_position_embeddings < args.prompt_tokens + args.steps + 16:
            sys.exit(f"--prompt-tokens {args.prompt_tokens} and --steps {args.steps} do not fit the model's "
                     f"{llm.model.config.max_position_embeddings} positions")
        timer = timed_engine(llm)
        rng = np.random.default_rng(0)
        rows = [measure(llm, timer, concurrency, args, rng) for concurrency in args.concurrency]
    print(f"{args.backend}: ms per decode step, {args.prompt_tokens}-token prompts, temperature {args.temperature}")
    print(format_table(("sequences", *PHASES, "host", "whole step", "longest step"), rows))


if __name__ == "__main__":
    main()
