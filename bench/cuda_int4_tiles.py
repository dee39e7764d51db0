"""The int4 GEMM's tilings against each other at a model's linear shapes, on a GPU: which one streams the
weight fastest at a decode's few rows.

    python bench/cuda_int4_tiles.py [--config bench/configs/llama-3-8b] [--rows 1] [--json FILE]
                                    [--save-table [FILE]] [--from-json FILE]

For each linear shape of the model (qkv, attention out, gate/up, down, LM head) and each candidate tiling
(the one `choose_config` picks, GEMV tilings, tensor-core tiles of 16 rows; each with K split for 2, 4
or 8 programs an SM), the time of one product is the median over replays of a CUDA graph of back-to-back
products, each on another copy of the weight (together past the L2 cache, as a step's layers are). Printed:
each shape's best tilings with their GB/s against the copy bandwidth measured in the same run, the bfloat16
cuBLAS product of the same shape, and per tiling the GEMM time of one decode step (every layer's four
products and the LM head). Each tiling's output is checked against the float32 product of the dequantized
weight; a mismatch is printed and the tiling left out.

At one row, --save-table writes each shape's fastest GEMV tiling as this GPU model's table (by default
where the cuda backend looks for the user's own: backends/cuda/kernels/gemv_tilings.py), which the
backend then takes for those shapes; --from-json derives it from an earlier run's --json file, without
a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from candelabra.backends.cuda.kernels import gemv_tilings

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3-8b"
PAST_L2_BYTES = 256 * 2**20
USER_TABLE = Path("the user's table for this GPU")  # --save-table's default, resolved once the GPU is known


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a Llama-like config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q_width, kv_width = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    return {"qkv": (q_width + 2 * kv_width, hidden), "out": (hidden, q_width),
            "gate_up": (2 * config["intermediate_size"], hidden), "down": (hidden, config["intermediate_size"]),
            "lm_head": (config["vocab_size"], hidden)}


def candidates(kernel) -> dict[str, object]:
    """Label to TileConfig (split_k left at 1; the sweep sets it): GEMV tilings 256 or 512 deep along K at 2
    or 4 warps that give a thread 32 to 128 bytes of weight a step (shallower tiles and fewer bytes gave a
    thread fewer outputs to share its x with, and more instructions a weight), each loading the next step's
    weight ahead of its math (s2) or not (s1), and the two best tensor-core tilings of the [K / 2, N]
    layout's sweep, each dequantizing before its dot or dotting the raw q - 8 per group."""
    TileConfig = kernel.TileConfig
    tilings = {}
    for block_n in (16, 32, 64, 128):
        for block_k in (256, 512):
            for warps in (2, 4):
                if 32 <= block_n * block_k // 2 // (32 * warps) <= 128:
                    for stages in (1, 2):
                        tilings[f"gemv n{block_n} k{block_k} w{warps} s{stages}"] = TileConfig(
                            1, block_n, block_k, num_warps=warps, num_stages=stages)
    for block_n, warps in ((32, 2), (64, 4)):
        for dequantized in (True, False):
            tilings[f"dot n{block_n} k128 w{warps} s3 {'dequantized' if dequantized else 'raw q-8'}"] = TileConfig(
                16, block_n, 128, num_warps=warps, num_stages=3, scale_after_dot=not dequantized)
    return tilings


def dequantized(torch, packed, scales, zeros):
    """float32 W.T [K, N] of the kernel's layout."""
    columns, half = packed.shape
    groups = half // 16
    low = (packed & 0xF).reshape(columns, groups, 16)
    high = (packed >> 4).reshape(columns, groups, 16)
    q = torch.cat([low, high], dim=2).float() - 8
    return (q * scales.float()[:, :, None] + zeros.float()[:, :, None]).reshape(columns, half * 2).T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a folder with a config.json")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch)")
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8], help="programs an SM to split K for")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--save-table", type=Path, nargs="?", const=USER_TABLE,
                        help="write each shape's fastest GEMV tiling as this GPU's table (default: the user's "
                             "table the cuda backend reads)")
    parser.add_argument("--from-json", type=Path, help="take the timings from this earlier --json run instead")
    args = parser.parse_args()
    if args.save_table and args.rows != 1:
        parser.error("--save-table keeps GEMV tilings, which serve one row: measure with --rows 1")
    shapes = linear_shapes(json.loads((args.config / "config.json").read_text()))
    if args.from_json:
        run = json.loads(args.from_json.read_text())
        if set(run["results"]) != set(shapes) or run["rows"] != 1 and args.save_table:
            raise SystemExit(f"{args.from_json} measured {sorted(run['results'])} at {run['rows']} row(s), not "
                             f"{args.config.name}'s {sorted(shapes)} at one row")
    else:
        run = measure(args)
    if args.save_table:
        save_table(run, shapes, args.save_table)


def measure(args) -> dict:
    """Every timing of the run, printed as tables, as the --json file holds them."""
    import torch
    from cuda_decode import copy_bandwidth

    from candelabra.backends.cuda.availability import multiprocessor_count
    from candelabra.backends.cuda.gemv_tuning import graph_median_us
    from candelabra.backends.cuda.kernels import int4_matmul as kernel
    from candelabra.core.text_table import format_table

    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_int4_tiles.py needs a CUDA device; torch sees none")
    config = json.loads((args.config / "config.json").read_text())
    shapes = linear_shapes(config)
    layers = config["num_hidden_layers"]
    device = torch.device("cuda")
    sm_count = multiprocessor_count(device)
    bandwidth = copy_bandwidth(torch)
    generator = torch.Generator(device=device).manual_seed(0)
    tilings = candidates(kernel)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.config.name}, "
          f"{args.rows} row(s), x in bfloat16")
    results: dict[str, dict[str, dict]] = {shape: {} for shape in shapes}
    cublas: dict[str, float] = {}
    for shape, (columns, width) in shapes.items():
        one = width * columns // 2 + 2 * 2 * (width // 32) * columns
        copies = max(1, math.ceil(PAST_L2_BYTES / one))
        weights = [(torch.randint(0, 256, (columns, width // 2), dtype=torch.uint8, device=device,
                                  generator=generator),
                    torch.rand(columns, width // 32, device=device, generator=generator).to(torch.bfloat16) / 64,
                    torch.randn(columns, width // 32, device=device, generator=generator).to(torch.bfloat16) / 256)
                   for _ in range(copies)]
        x = torch.randn(args.rows, width, device=device, generator=generator).to(torch.bfloat16)
        expected = x.float() @ dequantized(torch, *weights[0])
        dense = [torch.randn(columns, width, device=device, generator=generator, dtype=torch.bfloat16)
                 for _ in range(max(1, math.ceil(PAST_L2_BYTES / (2 * width * columns))))]
        cublas[shape] = graph_median_us([lambda w=w, x=x: x @ w.T for w in dense])
        del dense
        chosen = kernel.choose_config(args.rows, columns, width, device, torch.bfloat16)
        trials = {"chosen": chosen}
        for label, tiling in tilings.items():
            for per_sm in args.splits:
                trials[f"{label} p{per_sm}"] = kernel.split_for_programs(tiling, args.rows, columns, width,
                                                                          per_sm * sm_count)
        for label, tiling in trials.items():
            try:
                got = kernel.int4_matmul(x, *weights[0], tiling).float()
                error = float(((got - expected) ** 2).mean() / (expected ** 2).mean())
                if not error < 1e-4:
                    print(f"{shape} {label}: NMSE {error:.2e} against the dequantized product; left out")
                    continue
                micros = graph_median_us([lambda w=w, t=tiling, x=x: kernel.int4_matmul(x, *w, t)
                                                 for w in weights])
            except Exception as failure:  # a tiling that does not build or launch is reported, not fatal
                print(f"{shape} {label}: {type(failure).__name__}: {str(failure)[:200]}")
                continue
            results[shape][label] = {"us": micros, "gbps": one / micros / 1e3, "nmse": error,
                                     "tiling": asdict(tiling)}
        del weights
        torch.cuda.empty_cache()
        ranked = sorted(results[shape].items(), key=lambda item: item[1]["us"])
        rows = [[label, f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['gbps'] * 1e9 / bandwidth:.0%}",
                 f"{cublas[shape] / r['us']:.2f}x"] for label, r in ranked[:8]]
        chosen = [item for item in ranked if item[0] == "chosen"]
        if chosen and chosen[0] not in ranked[:8]:
            label, r = chosen[0]
            rows.append([label, f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['gbps'] * 1e9 / bandwidth:.0%}",
                         f"{cublas[shape] / r['us']:.2f}x"])
        picked = results[shape].get("chosen", {}).get("tiling")
        print(f"\n{shape} N={columns} K={width}: bfloat16 cuBLAS {cublas[shape]:.1f} us; chosen: {picked}")
        print(format_table(["tiling", "us", "GB/s", "of copy", "vs bf16"], rows))

    per_layer = {"qkv", "out", "gate_up", "down"}
    step = {}
    for label in set().union(*(results[shape] for shape in shapes)):
        if all(label in results[shape] for shape in shapes):
            step[label] = sum(results[shape][label]["us"] * (layers if shape in per_layer else 1)
                              for shape in shapes) / 1e3
    best_each = sum(min(r["us"] for r in results[shape].values()) * (layers if shape in per_layer else 1)
                    for shape in shapes) / 1e3
    dense_step = sum(cublas[shape] * (layers if shape in per_layer else 1) for shape in shapes) / 1e3
    print(f"\nGEMM time of one decode step ({layers} layers + LM head): bfloat16 cuBLAS {dense_step:.2f} ms; "
          f"int4 with each shape's best tiling {best_each:.2f} ms")
    ranked = sorted(step.items(), key=lambda item: item[1])
    print(format_table(["one tiling for every shape", "step ms"], [[label, f"{ms:.2f}"] for label, ms in ranked[:10]]
                       + [[label, f"{ms:.2f}"] for label, ms in ranked if label == "chosen"]))
    run = {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": args.rows, "cublas_us": cublas,
           "results": results, "step_ms": step, "best_each_ms": best_each, "dense_step_ms": dense_step,
           "config": args.config.name, "measured": time.strftime("%Y-%m-%d")}
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    return run


def fastest_gemv_tilings(run: dict, shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, int], object]:
    """Per [N, K], the GEMV tiling (block_m 1) of the run that took least time."""
    fastest = {}
    for shape, (columns, width) in shapes.items():
        gemvs = [r for r in run["results"][shape].values() if r["tiling"]["block_m"] == 1]
        if gemvs:
            tiling = min(gemvs, key=lambda r: r["us"])["tiling"]
            fastest[columns, width] = gemv_tilings.GemvTiling(*(tiling[field] for field in gemv_tilings.FIELDS))
    return fastest


def save_table(run: dict, shapes: dict[str, tuple[int, int]], path: Path) -> None:
    from candelabra.core.text_table import format_table

    fastest = fastest_gemv_tilings(run, shapes)
    source = (f"{run.get('measured', 'undated')}, bench/cuda_int4_tiles.py at {run.get('config', 'these')} "
              f"shapes, one row, x in bfloat16, scale groups of 32")
    path, tilings = gemv_tilings.save_measured(run["device"], fastest, source,
                                               path=None if path is USER_TABLE else path)
    by_shape = {value: name for name, value in shapes.items()}
    print(f"\n{run['device']}'s GEMV table, {path} ({len(fastest)} shapes written, {len(tilings)} in all):")
    print(format_table(["shape", "N", "K", *gemv_tilings.FIELDS],
                       [[by_shape.get(shape, "-"), *shape, *(getattr(t, f) for f in gemv_tilings.FIELDS)]
                        for shape, t in sorted(fastest.items())]))


if __name__ == "__main__":
    main()
