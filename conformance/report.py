"""Summing conformance results up per op, as a table and as JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from candelabra.conformance.harness import FAILED, NOT_SUPPORTED, PASSED
from candelabra.core.text_table import format_table

HEADERS = ("op", "dtype", "cases", "passed", "failed", "not supported", "worst NMSE")


def summarize(results: list[dict], by=("op",)) -> dict:
    """Per op (or per `by` key tuple), in first-seen order: counts by status and the worst NMSE.
    An op on quantized weights counts apart, as "linear Q4_K"."""
    summary: dict = {}
    for result in results:
        values = [op_label(result) if k == "op" else result[k] for k in by]
        key = values[0] if len(by) == 1 else tuple(values)
        entry = summary.setdefault(key, {"cases": 0, PASSED: 0, FAILED: 0, NOT_SUPPORTED: 0, "worst_nmse": None,
                                         "kernels": {}})
        entry["cases"] += 1
        entry[result["status"]] += 1
        if result.get("kernel"):
            entry["kernels"][result["kernel"]] = entry["kernels"].get(result["kernel"], 0) + 1
        if result["worst_nmse"] is not None:
            entry["worst_nmse"] = max(entry["worst_nmse"] or 0.0, result["worst_nmse"])
    return summary


def op_label(result: dict) -> str:
    weight_format = result.get("weight_format")
    return f"{result['op']} {weight_format}" if weight_format else result["op"]


def table(results: list[dict]) -> str:
    """The table per op and dtype; with a `kernel` column where the backend overrides some ops with
    vendor kernels."""
    summary = summarize(results, by=("op", "dtype"))
    overrides = any(s["kernels"] for s in summary.values())
    rows = [
        (op, dtype, s["cases"], s[PASSED], s[FAILED], s[NOT_SUPPORTED],
         "" if s["worst_nmse"] is None else f"{s['worst_nmse']:.2e}",
         *([kernel_cell(s["kernels"], s["cases"])] if overrides else []))
        for (op, dtype), s in summary.items()
    ]
    return format_table((*HEADERS, "kernel") if overrides else HEADERS, rows)


def kernel_cell(kernels: dict[str, int], cases: int) -> str:
    """Which kernel the op's cases ran on a backend with overrides: "override" or "fell back" when
    every case that ran one ran the same, else each with its count; empty without overrides."""
    if len(kernels) == 1 and sum(kernels.values()) == cases:
        return next(iter(kernels))
    return ", ".join(f"{kernel} {count}" for kernel, count in kernels.items())


MODEL_HEADERS = ("model case", "architecture", "status", "logits NMSE", "greedy tokens")


def model_table(results: list[dict]) -> str:
    rows = [(r["case"], r["architecture"], r["status"], nmse_cell(r), r["greedy"]) for r in results]
    return format_table(MODEL_HEADERS, rows)


def nmse_cell(result: dict) -> str:
    """A models-level NMSE, how many prompt positions it left out as routed at an expert tie, and what the
    backend may round activations to, where it said so."""
    if result["nmse"] is None:
        return ""
    tied = result.get("tied_positions", 0)
    rounded = result.get("activations")
    return (f"{result['nmse']:.2e}" + (f" ({tied} at an expert tie left out)" if tied else "")
            + (f" (x may be rounded to {rounded})" if rounded else ""))


ENGINE_HEADERS = ("engine case", "status", "detail")


def engine_table(results: list[dict]) -> str:
    return format_table(ENGINE_HEADERS, [(r["case"], r["status"], r["detail"]) for r in results])


PARALLEL_HEADERS = ("parallel case (2 ranks)", "status", "detail")


def parallel_table(results: list[dict]) -> str:
    return format_table(PARALLEL_HEADERS, [(r["case"], r["status"], r["detail"]) for r in results])


def write_json(path: str | os.PathLike, header: dict, results: list[dict], model_results: list[dict] = (),
               engine_results: list[dict] = (), parallel_results: list[dict] = ()) -> None:
    by_dtype: dict[str, dict] = {}
    for (op, dtype), counts in summarize(results, by=("op", "dtype")).items():
        by_dtype.setdefault(op, {})[dtype] = counts
    document = _strict({**header, "summary": summarize(results), "summary_by_dtype": by_dtype, "cases": results,
                        "models": list(model_results), "engine": list(engine_results),
                        "parallel": list(parallel_results)})
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=2, allow_nan=False))
    temporary.replace(target)


def _strict(value):
    """JSON has no infinity or NaN: write them as the strings "inf", "-inf" and "nan"."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
