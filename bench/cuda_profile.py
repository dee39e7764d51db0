"""Where a decode step's time goes on a GPU: a torch.profiler trace of a few steps, the host's share of
each step, and the sampling kernel with top-p on against greedy.

    python bench/cuda_profile.py [--config bench/configs/llama-3-8b] [--batches 1 64] [--steps 8]
                                 [--vocab 151936 128256] [--out FOLDER] [--backend cuda]
                                 [--quantization Q4_K] [--no-sampling]

For each batch, requests of random ids (--load-format dummy weights in bfloat16) are prefilled, a few
decode steps warm up (graphs captured, kernels compiled), then --steps decode steps run under
torch.profiler. Printed per batch: the wall time of a step, the time the GPU was busy inside it (the
union of its kernels' intervals), the rest (the host's work while the GPU waits: step preparation,
copies, sampling's launches, the engine), and the kernels that added the most to the step: a kernel's
exposed time is how far it ran past the end of every kernel before it, so a kernel that ran beside the
one before it (a dependent launch's start and prefetch) counts only what it added after that one ended,
and the exposed times of a step add up to its busy time. Each beside its own run time. The trace is
written to --out as Chrome JSON (open it in chrome://tracing or ui.perfetto.dev).

Then `Ops.sample` alone, on random logits of each --vocab at each batch: greedy, and temperature 1 with
top-p 0.9, the GPU's time a call (`median_ms`: calls queued behind a busy GPU, timed with CUDA events).
bench/gpu_check.sh's `profile` step runs this.

--backend torch runs the same on a CPU (no graphs, no CUDA events: wall time), to try the script out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from candelabra.core.contract.weights import INT4_GROUP_FORMATS
from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.text_table import format_table

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3-8b"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the [start, end) intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


def launch_gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """For each kernel after the first, in order of start: how long after every earlier one had ended it
    started (negative where it started before that, as a dependent launch may)."""
    gaps, reach = [], None
    for start, end in sorted(intervals):
        if reach is not None:
            gaps.append(start - reach)
        reach = end if reach is None else max(reach, end)
    return gaps


def exposed_by_name(kernels: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
    """Per kernel name, (its run time, its exposed time) summed over `kernels` (name, start, end): exposed
    is how far each ran past the end of every kernel that started before it, so the exposed times add up
    to the union of the intervals."""
    totals: dict[str, tuple[float, float]] = {}
    reach = float("-inf")
    for name, start, end in sorted(kernels, key=lambda kernel: (kernel[1], kernel[2])):
        exposed = max(0.0, end - max(start, reach))
        reach = max(reach, end)
        run, hidden_before = totals.get(name, (0.0, 0.0))
        totals[name] = (run + end - start, hidden_before + exposed)
    return totals


def device_kernels(profile, on_gpu: bool) -> list:
    """The profile's device kernels (on a GPU), or its top-level CPU ops (on a CPU)."""
    events = profile.events()
    if on_gpu:
        return [event for event in events if event.device_type.name == "CUDA"]
    return [event for event in events if event.cpu_parent is None]


def profile_decode(llm: LLM, batch: int, steps: int, rng, out: Path, on_gpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine, vocab = llm.engine, llm.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"profile-{batch}-{index}", rng.integers(0, vocab, 64).tolist(), params)
    for _ in range(6):  # the prefills, then decodes that capture and compile
        engine.step()
    llm.backend.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as trace:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        llm.backend.synchronize()
        wall = (time.perf_counter() - started) / steps
    while engine.has_unfinished_requests():
        engine.step()
    trace.export_chrome_trace(str(out / f"decode-batch{batch}.trace.json"))
    kernels = device_kernels(trace, on_gpu)
    intervals = [(k.time_range.start, k.time_range.end) for k in kernels]
    busy = busy_union(intervals) / 1e6 / steps
    gaps = launch_gaps(intervals)
    overlapped = (sum(end - start for start, end in intervals) / 1e6 / steps) - busy
    totals = exposed_by_name([(k.name, k.time_range.start, k.time_range.end) for k in kernels])
    top = sorted(((name, run / 1e3 / steps, exposed / 1e3 / steps) for name, (run, exposed) in totals.items()),
                 key=lambda item: -item[2])[:12]
    return {"batch": batch, "step_ms": wall * 1e3, "busy_ms": busy * 1e3, "host_ms": max(0.0, wall - busy) * 1e3,
            "kernels": len(kernels) / steps, "median_gap_us": float(np.median(gaps)) if gaps else 0.0,
            "overlapped_ms": overlapped * 1e3, "top": top}


def time_sampling(llm: LLM, vocab: int, batch: int, top_p: float, temperature: float, on_gpu: bool) -> float:
    """Median ms of one `Ops.sample` call over random logits [batch, vocab]."""
    from candelabra.core.contract.step_metadata import plain_sampling

    rng = np.random.default_rng(vocab + batch)
    meta = plain_sampling(temperature, top_p, rng.random(batch, dtype=np.float32))
    backend = llm.backend
    prepared = backend.prepare_sampling(meta)
    logits = backend.to_device(rng.standard_normal((batch, vocab)).astype(np.float32) * 4, "float32")
    return median_ms(lambda: backend.ops.sample(logits, prepared), on_gpu)


# How the cuda backend may find a batch's top-k and top-p thresholds, as the module settings that pick
# each: among torch.topk's candidates, one program searching each row alone, or passes split over programs.
SEARCH_PATHS = {
    "candidates": {"CANDIDATE_ROWS": 1 << 30},
    "one program a row": {"CANDIDATE_ROWS": 0, "SEARCH_CHUNK": 1 << 30},
    "split passes": {"CANDIDATE_ROWS": 0},
}


def time_search_paths(llm: LLM, vocab: int, batch: int, on_gpu: bool) -> dict[str, float]:
    """Top-p 0.9 timed (as time_sampling) down each of the cuda backend's SEARCH_PATHS."""
    from candelabra.backends.cuda.kernels import sampling

    times = {}
    for path, settings in SEARCH_PATHS.items():
        saved = {name: getattr(sampling, name) for name in settings}
        try:
            for name, value in settings.items():
                setattr(sampling, name, value)
            times[path] = time_sampling(llm, vocab, batch, 0.9, 1.0, on_gpu)
        finally:
            for name, value in saved.items():
                setattr(sampling, name, value)
    return times


def median_ms(call, on_gpu: bool = True, repeats: int = 9, calls: int = 20) -> float:
    """Median ms of one `call()` over `repeats` runs of `calls` back to back, after 3 warm-ups. On a GPU the
    time between CUDA events around calls the host queued while the GPU was held busy beforehand, so that
    it is the GPU's time alone, as in a step the host launches ahead of (a call timed by itself between
    synchronizations also counts the GPU waiting on each of its launches); elsewhere wall time."""
    import torch

    for _ in range(3):
        call()
    if on_gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if on_gpu:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            for _ in range(calls):
                call()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / calls)
        else:
            started = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - started) * 1e3 / calls)
    return float(np.median(times))


# GPU clock cycles the GPU spins before a timed run (about 50 ms): time for the host to queue every call.
HOLD_CYCLES = 100_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a folder with a config.json")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 128256])
    parser.add_argument("--kv-cache-mb", type=float, default=8192)
    parser.add_argument("--quantization", choices=["Q4_K", *INT4_GROUP_FORMATS],
                        help="dummy linear weights in this int4 format (Q4_K, or grouped as GPTQ and AWQ load: "
                             "int4 on the GPU) instead of --dtype")
    parser.add_argument("--no-sampling", action="store_true", help="skip the sampling timings")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="schedule each step before the one running has returned its tokens (default: the "
                             "engine's, on for cuda)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where the traces and profile.json go")
    args = parser.parse_args()
    if args.steps < 1 or min(args.batches) < 1:
        parser.error("--steps and --batches must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)

    llm = LLM(str(args.config), backend=args.backend, dtype=args.dtype, load_format="dummy",
              dummy_quantization=args.quantization,
              kvcache_mem_gpu=args.kv_cache_mb, kvcache_mem_cpu=0, max_num_seqs=max(args.batches),
              async_scheduling=args.async_scheduling)
    on_gpu = llm.backend.name == "cuda" and getattr(llm.backend, "torch_device", None) is not None \
        and llm.backend.torch_device.type == "cuda"
    rng = np.random.default_rng(0)
    steps = [profile_decode(llm, batch, args.steps, rng, args.out, on_gpu) for batch in args.batches]
    ahead = ", scheduled ahead" if llm.engine.core.config.async_scheduling else ", in turn"
    print(f"{args.config.name} in {args.dtype} on {llm.backend.probe().detail}; {args.steps} decode steps profiled"
          f"{ahead}")
    print(format_table(("batch", "step ms", "GPU busy ms" if on_gpu else "ops ms", "host ms", "kernels a step",
                        "median gap µs", "overlapped ms"),
                       [(s["batch"], f"{s['step_ms']:.2f}", f"{s['busy_ms']:.2f}", f"{s['host_ms']:.2f}",
                         f"{s['kernels']:.0f}", f"{s['median_gap_us']:.2f}", f"{s['overlapped_ms']:.3f}")
                        for s in steps]))
    print("median gap: from the end of the kernels before to a kernel's start (negative: it started before "
          "they ended, as a dependent launch may); overlapped: kernel time a step beyond the GPU's busy time")
    for s in steps:
        print(f"batch {s['batch']}, what adds most to a step (exposed: past the end of every kernel before it):")
        print(format_table(("kernel", "exposed ms a step", "run ms a step"),
                           [(name[:90], f"{exposed:.3f}", f"{run:.3f}") for name, run, exposed in s["top"]]))

    sampling = []
    for vocab in [] if args.no_sampling else args.vocab:
        for batch in args.batches:
            greedy = time_sampling(llm, vocab, batch, 1.0, 0.0, on_gpu)
            top_p = time_sampling(llm, vocab, batch, 0.9, 1.0, on_gpu)
            paths = time_search_paths(llm, vocab, batch, on_gpu) if llm.backend.name == "cuda" else {}
            sampling.append({"vocab": vocab, "batch": batch, "greedy_ms": greedy, "top_p_ms": top_p,
                             "top_p_ms_by_path": paths})
    if sampling:
        print(format_table(("vocab", "batch", "greedy ms", "top-p 0.9 ms", *(f"{path} ms" for path in SEARCH_PATHS)),
                           [(s["vocab"], s["batch"], f"{s['greedy_ms']:.3f}", f"{s['top_p_ms']:.3f}",
                             *(f"{s['top_p_ms_by_path'][path]:.3f}" if s["top_p_ms_by_path"] else ""
                               for path in SEARCH_PATHS))
                            for s in sampling]))
    (args.out / "profile.json").write_text(json.dumps({"device": llm.backend.probe().detail, "steps": steps,
                                                       "sampling": sampling}, indent=2) + "\n")


if __name__ == "__main__":
    main()
