"""The suite can fail: run it on backends with one subtly wrong op and expect exactly that op."""

import json
from pathlib import Path

import pytest

from candelabra.core.contract.ops import FUSED_OPS, OP_NAMES
from support import run_candelabra

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("backend, broken_op", [
    ("SlidingWindowOffByOne", "paged_attention"),
    ("PaddingSlotWrite", "write_kv"),
    ("UnshiftedSoftmax", "softmax"),
    ("InclusiveTopP", "sample"),
    ("UnwrittenOutputRow", "silu_and_mul"),
])
def test_conformance_catches_exactly_the_broken_op(tmp_path, backend, broken_op):
    results = tmp_path / "results.json"
    run = run_candelabra("conformance", "--backend", f"broken_backends:{backend}", "--level", "ops", "--json",
                         str(results),
                         env_extra={"PYTHONPATH": str(TESTS)})

    assert run.returncode == 1, run.stdout + run.stderr
    summary = json.loads(results.read_text())["summary"]
    failing = {op for op, counts in summary.items() if counts["failed"]}
    # A fused op whose default runs the broken op in turn fails with it.
    assert failing == {broken_op} | {fused for fused, parts in FUSED_OPS.items() if broken_op in parts}
    assert summary[broken_op]["passed"] > 0, "only the cases that exercise the bug should fail"
    # Rows apart from the ops ("linear Q4_K") are quantized weights, which the numpy backend keeps none of.
    assert all(counts["not supported"] == 0 for op, counts in summary.items() if op in OP_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("backend, broken_ops", [
    ("LowPrecisionRmsNorm", {"rms_norm", "add_rms_norm"}),  # add_rms_norm normalises through rms_norm
    ("DoubleRoundedSilu", {"silu_and_mul"}),
])
def test_conformance_catches_low_precision_arithmetic_at_exactly_the_low_precision_dtypes(tmp_path, backend,
                                                                                          broken_ops):
    results = tmp_path / "results.json"
    ops = [arg for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "gelu_and_mul") for arg in ("--op", op)]
    run = run_candelabra("conformance", "--backend", f"broken_backends:{backend}", "--level", "ops", *ops,
                         "--json", str(results), env_extra={"PYTHONPATH": str(TESTS)})

    assert run.returncode == 1, run.stdout + run.stderr
    by_dtype = json.loads(results.read_text())["summary_by_dtype"]
    failing = {(op, dtype) for op, dtypes in by_dtype.items() for dtype, counts in dtypes.items() if counts["failed"]}
    assert failing == {(op, dtype) for op in broken_ops for dtype in ("float16", "bfloat16")}
