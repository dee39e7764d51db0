"""Does torch.compile pay for the torch backend's decode step? Start-up cost beside the time per step.

    python bench/torch_compile_decode.py [--mode eager ops forward] [--steps 30]

Each mode loads the default model on the torch backend in a fresh process, decodes one request and
reports the time of its first steps (compilation included) and the mean time of the next --steps
decode steps at batch 1: "eager" as shipped, "ops" with the norms, the gated activation and rotary
compiled, "forward" with the whole model forward compiled (dynamic shapes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from candelabra.core.text_table import format_table

COMPILED_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary")


def measure(mode: str, steps: int) -> dict:
    import numpy as np
    import torch

    from candelabra.core.llm import LLM
    from candelabra.core.requests.sampling_params import SamplingParams

    llm = LLM(None, backend="torch", kvcache_mem_gpu=256, kvcache_mem_cpu=0)
    if mode == "ops":
        for name in COMPILED_OPS:
            setattr(llm.model.ops, name, torch.compile(getattr(llm.model.ops, name), dynamic=True))
    elif mode == "forward":
        llm.model.forward = torch.compile(llm.model.forward, dynamic=True)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    llm.engine.add_request("decode", np.random.default_rng(0).integers(100, 150000, 64).tolist(), params)
    start = time.perf_counter()
    for _ in range(4):
        llm.engine.step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return {"mode": mode, "first_steps_s": first, "step_ms": (time.perf_counter() - start) / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", default=["eager", "ops", "forward"], choices=("eager", "ops", "forward"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps)))
        return
    rows = []
    for mode in args.mode:
        run = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append((mode, f"{result['first_steps_s']:.1f}", f"{result['step_ms']:.1f}"))
    print(format_table(("mode", "first 4 steps, s (compilation included)", "ms per decode step"), rows))


if __name__ == "__main__":
    main()
