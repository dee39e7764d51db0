"""How long in-situ quantization (--isq) takes on a real model's weights: every weight --isq would
quantize in the default model (Qwen2.5-Coder-0.5B-Instruct; or the GGUF file --model names), read and
dequantized to float32 first as a dense checkpoint would hand it over (not timed), then quantized
as the loader does it, on all cores.

    python bench/isq_load_time.py [--model PATH] [--formats q4k,q8_0,...] [--threads N]

Prints, per format asked for, the weights in each format they took (the fallback to Q8_0 where the
in_features are not whole blocks), their values, the seconds (wall, and CPU seconds of all threads,
which tell more on a machine others share) and the rate.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections import defaultdict

from candelabra.core.loading.in_situ import isq_format, quantization_plan
from candelabra.core.text_table import format_table
from candelabra.core.weights.default_model import default_model_path
from candelabra.core.weights.gguf import GGUFCheckpoint
from candelabra.core.weights.quantize import quantize


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the default model)")
    parser.add_argument("--formats", default="q4k", help="comma-separated --isq formats (default q4k)")
    parser.add_argument("--threads", type=int, help="threads quantizing (default: one a core)")
    args = parser.parse_args()
    with GGUFCheckpoint(args.model or default_model_path()) as checkpoint:
        plans = {format: quantization_plan(checkpoint, isq_format(format)) for format in args.formats.split(",")}
        names = sorted({name for plan in plans.values() for name, kind in plan.items() if kind is not None})
        start = time.perf_counter()
        dense = {name: checkpoint.load(name) for name in names}
        print(f"read and dequantized {len(dense)} weights in {time.perf_counter() - start:.1f} s "
              f"({sum(w.size for w in dense.values()) / 1e6:.0f} M values)")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; threads: {args.threads or os.cpu_count()}")
    rows = []
    for asked, plan in plans.items():
        seconds, cpu, values, counts = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(int)
        for name, format in plan.items():
            if format is None:
                continue
            start, start_cpu = time.perf_counter(), time.process_time()
            quantize(dense[name], format, args.threads)
            seconds[format] += time.perf_counter() - start
            cpu[format] += time.process_time() - start_cpu
            values[format] += dense[name].size
            counts[format] += 1
        for format in seconds:
            rows.append((asked, format, counts[format], f"{values[format] / 1e6:.0f}", f"{seconds[format]:.1f}",
                         f"{cpu[format]:.1f}", f"{values[format] / seconds[format] / 1e6:.0f}"))
        rows.append((asked, "all", sum(counts.values()), f"{sum(values.values()) / 1e6:.0f}",
                     f"{sum(seconds.values()):.1f}", f"{sum(cpu.values()):.1f}", ""))
    print(f"load average: {', '.join(f'{load:.1f}' for load in os.getloadavg())}")
    print(format_table(("--isq", "format", "weights", "M values", "seconds", "CPU s", "M values/s"), rows))


if __name__ == "__main__":
    main()
