"""The torch backend's `sample` op against an earlier revision of it, interleaved in one process.

    python bench/torch_sampling.py [--baseline HEAD] [--vocab 151936] [--rows 1 16 64] [--repeats 7] [--threads N]

The baseline is backends/torch/sampling.py as `git show` gives it at --baseline; the other is the
working tree's. Each case (rows, dtype, sampling mode) times both in alternation, --repeats rounds
of a few calls each, and the table gives each one's median milliseconds per call, wall clock and
process CPU time. Random logits (standard normal times 3); "same" says whether both chose the same
tokens with the same logprobs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from candelabra.backends.torch import sampling as current
from candelabra.backends.torch.host_memory import keep_freed_memory_for_reuse
from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists
from candelabra.core.text_table import format_table

MODES = {  # name: temperature, top_k, top_p, num_top_logprobs
    "greedy": (0.0, 0, 1.0, 0),
    "t1": (1.0, 0, 1.0, 0),
    "t0.7 p0.9": (0.7, 0, 0.9, 0),
    "k40": (1.0, 40, 1.0, 0),
    "t1 logprobs5": (1.0, 0, 1.0, 5),
    "t1.5 p0.999": (1.5, 0, 0.999, 0),  # a nucleus of most of the vocabulary: top-p's worst case
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def module_at(revision: str) -> types.ModuleType:
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{revision}:backends/torch/sampling.py"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"sampling_at_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"sampling.py@{revision}", "exec"), module.__dict__)
    return module


def metadata(rng: np.random.Generator, rows: int, mode: str) -> SamplingMetadata:
    temperature, top_k, top_p, logprobs = MODES[mode]
    empty = pad_token_lists([[]] * rows)
    return SamplingMetadata(
        temperature=np.full(rows, temperature, np.float32), top_k=np.full(rows, top_k, np.int32),
        top_p=np.full(rows, top_p, np.float32), min_p=np.zeros(rows, np.float32),
        repetition_penalty=np.ones(rows, np.float32), presence_penalty=np.zeros(rows, np.float32),
        frequency_penalty=np.zeros(rows, np.float32), penalty_tokens=empty, output_tokens=empty,
        bias_token_ids=empty, bias_values=np.zeros(empty.shape, np.float32),
        uniform=rng.random(rows, dtype=np.float32), num_top_logprobs=logprobs)


def seconds_per_call(module, logits: torch.Tensor, meta: SamplingMetadata, calls: int) -> tuple[float, float]:
    """Wall-clock and process CPU seconds per call: on a shared machine, with one thread, the CPU time
    leaves out the time the process waited for a core."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        module.sample(logits, module.TorchSampling.prepare(meta, logits.device))
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory_for_reuse()  # as the torch backend does on a CPU
    baseline = module_at(args.baseline)
    rng = np.random.default_rng(0)
    table = []
    for rows in args.rows:
        calls = max(1, 32 // rows)
        for dtype in DTYPES:
            logits = torch.from_numpy(rng.standard_normal((rows, args.vocab), dtype=np.float32) * 3).to(DTYPES[dtype])
            for mode in args.modes:
                meta = metadata(rng, rows, mode)
                before = baseline.sample(logits, baseline.TorchSampling.prepare(meta, logits.device))
                after = current.sample(logits, current.TorchSampling.prepare(meta, logits.device))
                same = (torch.equal(before.token_ids, after.token_ids) and torch.equal(before.logprobs, after.logprobs)
                        and torch.equal(before.top_logprobs, after.top_logprobs))
                times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
                for _ in range(args.repeats):
                    times["before"].append(seconds_per_call(baseline, logits, meta, calls))
                    times["after"].append(seconds_per_call(current, logits, meta, calls))
                wall = {name: 1e3 * statistics.median(t[0] for t in values) for name, values in times.items()}
                cpu = {name: 1e3 * statistics.median(t[1] for t in values) for name, values in times.items()}
                table.append([rows, dtype, mode, f"{wall['before']:.2f}", f"{wall['after']:.2f}",
                              f"{wall['before'] / wall['after']:.2f}x", f"{cpu['before']:.2f}", f"{cpu['after']:.2f}",
                              f"{cpu['before'] / cpu['after']:.2f}x", "yes" if same else "NO"])
                print(*table[-1], sep="\t", flush=True)
    print(f"\nvocabulary {args.vocab}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"baseline {args.baseline}; median ms per call of {args.repeats} interleaved rounds, wall clock and "
          "process CPU time")
    print(format_table(["rows", "dtype", "mode", "before", "after", "speed-up", "before CPU", "after CPU", "speed-up",
                        "same"], table))


if __name__ == "__main__":
    main()
