"""The rows of the torch backend's kernel table (backends/torch/kernel_table.py) for this CPU, measured as
`candelabra tune --backend torch` measures them, printed as the code of the table's rows.

    python bench/cpu_kernel_table.py [--dtype bfloat16] [--format Q5_0 ...] [--isa avx512]
                                     [--kernel-variant avx2] [--output rows.json]

Every timing goes beside the rows (rows.timings.json). --kernel-variant measures the C kernels of a smaller
ISA variant than this CPU's best, and --isa names the level the rows are written for. To measure an AVX2
CPU's rows on an AVX-512 one, limit torch and oneDNN too:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_kernel_table.py --isa avx2 \\
        --kernel-variant avx2 --dtype float32

The rows then hold that instruction set's kernels on this CPU's memory and caches, which the row's
`measured` says. Run it on a quiet machine; the report names the formats measured while other processes
kept the CPUs busy.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from candelabra.backends.torch.cpu import kernel_library
from candelabra.backends.torch.cpu.features import cpu_model_name, usable_cores
from candelabra.backends.torch.kernel_table import ISA_LEVELS, ROW_BANDS, isa_level
from candelabra.backends.torch.kernel_tuning import TUNE_SHAPES, report, tune
from candelabra.core.contract.weights import QUANTIZED_FORMATS


def row_code(row) -> str:
    """A tuned row as the `_row(...)` call kernel_table.py writes its rows in."""
    forms = ", ".join(f'"{c.form}": "{_runs(c.kernels)}"' for c in row.choices)
    activations = "" if row.activations == "exact" else f', activations="{row.activations}"'
    return (f'_row("{" ".join(sorted(row.formats))}", "{" ".join(sorted(row.dtypes))}", "{row.isa}", '
            f'{{{forms}}}, MEASURED{activations}),')


def _runs(kernels: tuple[str, ...]) -> str:
    words, index = [], 0
    while index < len(kernels):
        count = 1
        while index + count < len(kernels) and kernels[index + count] == kernels[index]:
            count += 1
        words.append(kernels[index] if count == 1 else f"{kernels[index]}*{count}")
        index += count
    return " ".join(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", action="append", dest="dtypes", help="repeatable (default bfloat16)")
    parser.add_argument("--format", action="append", dest="formats", help="repeatable (default: all)")
    parser.add_argument("--isa", choices=ISA_LEVELS, help="the level the rows are for (default: this CPU's)")
    parser.add_argument("--kernel-variant", help="the C kernel variant to measure (default: this CPU's best)")
    parser.add_argument("--output", type=Path, default=Path("kernel-rows.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.kernel_variant:
        kernel_library.prefer(args.kernel_variant)
        loaded = kernel_library.kernels()
        if loaded.library is None:
            print(f"error: {loaded.detail}", file=sys.stderr)
            return 2
    threads = usable_cores()
    torch.set_num_threads(threads)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{cpu_model_name()}, {threads} threads, torch {torch.__version__} ({capability}), C kernels:"
          f" {kernel_library.kernels().detail}; shapes {TUNE_SHAPES}, bands {ROW_BANDS}", flush=True)
    _, tuned = tune(args.dtypes or ["bfloat16"], args.formats or list(QUANTIZED_FORMATS), threads,
                    output=args.output, progress=lambda what: print(f"measuring {what}", file=sys.stderr, flush=True))
    level = args.isa or isa_level()
    tuned = [replace(t, row=replace(t.row, isa=level)) for t in tuned]
    print(report(tuned, threads))
    print("\n".join(row_code(t.row) for t in tuned))
    evidence = args.output.with_suffix(".timings.json")
    evidence.write_text(json.dumps([{"formats": sorted(t.row.formats), "dtypes": sorted(t.row.dtypes),
                                     "activations": t.row.activations, "sizes": t.sizes,
                                     "timings": [asdict(timing) for timing in t.timings]} for t in tuned], indent=1))
    print(f"rows in {args.output}, every timing in {evidence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
