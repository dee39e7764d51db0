"""The suite can fail: run it on backends with one subtly wrong op and expect exactly that op."""

import json
from pathlib import Path

import pytest

import broken_backends
from candelabra.conformance.harness import FAILED, run_case
from candelabra.conformance.op_cases import op_cases
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
    assert failing == ops_running(broken_op)
    assert summary[broken_op]["passed"] > 0, "only the cases that exercise the bug should fail"
    # Rows apart from the ops ("linear Q4_K") are quantized weights, which the numpy backend keeps none of.
    assert all(counts["not supported"] == 0 for op, counts in summary.items() if op in OP_NAMES)


def ops_running(op: str) -> set[str]:
    """`op` and every fused op whose default runs it, directly or through another fused op."""
    running = {op}
    while grown := {fused for fused, parts in FUSED_OPS.items() if running & set(parts)} - running:
        running |= grown
    return running


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


def failures_of(backend, op, dtype="float32", seed=7, kv_dtype=None):
    """The messages of the backend's failing cases of `op`, run in process; with `kv_dtype`, its cases
    over a cache in that dtype."""
    cases = [case for case in op_cases(backend.dtypes, backend.kv_cache_dtypes) if case.op == op
             and case.dtype == dtype and dict(case.params).get("kv_dtype") == kv_dtype]
    assert cases, f"no {op} cases"
    return [result.message for case in cases if (result := run_case(backend, case, seed)).status == FAILED]


def test_a_backend_missing_required_methods_is_refused_when_built_naming_them_and_the_page():
    with pytest.raises(TypeError) as refused:
        broken_backends.MissingSynchronizeAndDtypeOf()
    assert "MissingSynchronizeAndDtypeOf does not implement dtype_of, synchronize" in str(refused.value)
    assert "docs/backend-contract.md" in str(refused.value)


def test_a_no_op_swap_out_is_named_as_swap_outs_and_swap_in_is_not_blamed():
    backend = broken_backends.NoOpSwapOut()
    out, back = failures_of(backend, "swap_out"), failures_of(backend, "swap_in")
    assert out and all("swap_out did not copy device blocks" in message for message in out)
    assert back and all("swap_in not checked: swap_out did not fill the swap space" in message for message in back)


def test_a_no_op_swap_in_fails_only_swap_in_naming_the_blocks_it_left():
    backend = broken_backends.NoOpSwapIn()
    assert failures_of(backend, "swap_out") == []
    back = failures_of(backend, "swap_in")
    assert back and all("differ after swap_in from host blocks" in message for message in back)


def test_a_nan_in_an_output_is_counted_and_named_not_reported_as_an_infinite_error():
    messages = failures_of(broken_backends.NanInOutput(), "gelu")
    assert messages and all("1 NaN of" in m and "where the reference is finite" in m for m in messages)
    assert not any("NMSE inf" in m for m in messages)


def test_a_norm_computed_in_bfloat16_while_declaring_float32_is_named_as_lower_precision():
    messages = failures_of(broken_backends.NormAccumulatedInBfloat16(), "rms_norm")
    assert messages and all("bfloat16 arithmetic" in m and "dtype is float32" in m for m in messages)


def test_writing_padding_tokens_names_the_no_slot_padding():
    messages = failures_of(broken_backends.PaddingSlotWrite(), "write_kv")
    assert messages and all("a token whose slot is NO_SLOT (-1) was written" in m for m in messages)


def test_writing_the_wrong_slots_names_the_steps_slots_and_the_ones_outside_it():
    messages = failures_of(broken_backends.WritesNextSlot(), "write_kv")
    assert messages and all("of the step's" in m and "slots hold wrong values" in m for m in messages)
    assert any("slots outside the step changed" in m for m in messages)


def test_empty_top_tensors_of_the_wrong_shape_are_named_by_their_shape():
    messages = failures_of(broken_backends.FlatTopWhenNoneAsked(), "token_logprobs")
    assert messages and all("top token ids shape" in m for m in messages)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_an_overflowing_softmax_is_named_as_non_finite_values():
    messages = failures_of(broken_backends.UnshiftedSoftmax(), "softmax")
    assert messages and all("NaN" in m and "overflow" in m for m in messages)


def test_an_output_row_left_unwritten_is_named_as_never_written():
    """NaN when the poisoned run's memory comes back to the output, else whatever the memory held: either
    way the message says the row was not written."""
    messages = failures_of(broken_backends.UnwrittenOutputRow(), "silu_and_mul")
    assert messages and all("never written" in m or "left unwritten" in m for m in messages)


@pytest.mark.parametrize("backend, op", [("LowPrecisionRmsNorm", "rms_norm"), ("DoubleRoundedSilu", "silu_and_mul")])
def test_low_precision_arithmetic_is_named_as_a_second_rounding_or_a_low_precision_intermediate(backend, op):
    messages = failures_of(getattr(broken_backends, backend)(), op, dtype="bfloat16")
    assert messages and all("rounded twice, or an intermediate kept in bfloat16" in m for m in messages)


def test_expert_groups_scored_by_the_wrong_rule_fail_routing_by_their_expert_ids():
    messages = failures_of(broken_backends.GroupsScoredByMax(), "route_experts")
    assert messages and all(m.startswith("expert ids: not equal") for m in messages)
    assert len(messages) < len([case for case in op_cases(("float32",)) if case.op == "route_experts"])


def test_a_share_of_the_experts_indexed_from_zero_fails_exactly_the_cases_of_a_share():
    backend = broken_backends.ExpertsHeldFromZero()
    cases = [case for case in op_cases(backend.dtypes) if case.op == "moe_experts" and case.dtype == "float32"]
    failed = {case.id for case in cases if run_case(backend, case, seed=7).status == FAILED}
    assert failed and failed == {case.id for case in cases if ("held", "middle") in case.params}


def test_an_int8_cache_quantized_by_truncation_fails_its_writes_naming_the_codes():
    messages = failures_of(broken_backends.TruncatedKVCodes(), "write_kv", kv_dtype="int8")
    assert len(messages) == 2 and all("codes are not the nearest to value / scale" in m for m in messages)


def test_an_int8_cache_read_without_its_scales_fails_attention_over_it_only():
    backend = broken_backends.KVScaleDropped()
    assert len(failures_of(backend, "paged_attention", kv_dtype="int8")) == 3
    assert not failures_of(backend, "paged_attention")
