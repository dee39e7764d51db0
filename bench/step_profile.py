"""Where a decode step's time goes, op by op, on one backend.

    python bench/step_profile.py [--backend torch] [--model PATH] [--concurrency 1 16 64]
                                 [--temperature 0] [--steps 20]

For each concurrency, that many requests (random prompts of --prompt-tokens) are prefilled, then
--steps decode steps are timed, each op of the backend's `Ops` timed around its call. The table
gives milliseconds per step and calls per step for each op, and the step's time outside the ops
(scheduling, step preparation, the engine). Meaningful for eager backends (torch, cpu), whose ops
have finished when they return; a lazy one (metal) shows its work wherever it is evaluated.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import numpy as np

from candelabra.core.contract.ops import Ops
from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table


class OpTimer:
    """Wraps every public op of an `Ops` object to add up its time and calls."""

    def __init__(self, ops: Ops) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._depth = 0  # ops calling ops (add_rms_norm calls rms_norm) count once, in the outer one
        for name in _op_names():
            setattr(ops, name, self._timed(name, getattr(ops, name)))

    def _timed(self, name: str, op):
        @functools.wraps(op)
        def timed(*args, **kwargs):
            if self._depth:
                return op(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self._depth -= 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _op_names() -> list[str]:
    return [name for name, value in vars(Ops).items() if callable(value) and not name.startswith("_")]


def profile(llm: LLM, timer: OpTimer, concurrency: int, args, rng) -> list[tuple]:
    engine = llm.engine
    vocab = llm.model.config.vocab_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(concurrency):
        prompt = rng.integers(100, vocab - 100, args.prompt_tokens).tolist()
        engine.add_request(f"profile-{concurrency}-{i}", prompt, params)
    while engine.core.scheduler.waiting or any(not seq.num_output_tokens for seq in engine.core.scheduler.running):
        engine.step()  # every prompt prefilled: what follows are decode steps
    timer.reset()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    rows = [(concurrency, name, f"{seconds / args.steps * 1e3:.2f}", f"{seconds / step / args.steps:.0%}",
             timer.calls[name] // args.steps) for name, seconds in timer.seconds.most_common()]
    outside = step - sum(timer.seconds.values()) / args.steps
    while engine.has_unfinished_requests():
        engine.step()
    rows.append((concurrency, "(outside the ops)", f"{outside * 1e3:.2f}", f"{outside / step:.0%}", ""))
    rows.append((concurrency, "(whole step)", f"{step * 1e3:.2f}", "100%", ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy; a load generator's requests sample at 1 (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per row (default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    args = parser.parse_args()

    llm = LLM(args.model, backend=args.backend, dtype=args.dtype, kvcache_mem_gpu=2048, kvcache_mem_cpu=0,
              max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096, prefill_chunk_size=512)
    timer = OpTimer(llm.model.ops)
    rng = np.random.default_rng(0)
    rows = []
    for concurrency in args.concurrency:
        rows += profile(llm, timer, concurrency, args, rng)
    print(f"{args.backend} ({llm.model.dtype}): decode step, {args.prompt_tokens}-token prompts, "
          f"temperature {args.temperature}")
    print(format_table(("sequences", "op", "ms per step", "share", "calls per step"), rows))


if __name__ == "__main__":
    main()
