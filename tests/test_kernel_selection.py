"""A weight takes the first form its rows name whose kernels pass the float64 check: nothing is timed."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kernel_candidates import SHAPE, int8_and_dense_candidates, rounding_candidates

from candelabra.backends.torch import kernel_table
from candelabra.backends.torch.kernel_selection import (
    CHECKED_OUTPUTS,
    CHECKED_ROWS,
    Candidate,
    KernelSelector,
    check_choice,
    checked_rows,
)
from candelabra.backends.torch.kernel_table import EXACT, INT8, Choice, KernelRow
from candelabra.backends.torch.weight_forms import DenseWeight, Int8Weight


def row(*choices: Choice, activations=EXACT, measured="a test row") -> KernelRow:
    return KernelRow(frozenset({"Q5_0"}), frozenset({"bfloat16"}), "avx2", choices, measured, activations)


INT8_FIRST = row(Choice("int8", ("int8_mm", "int8_mm", "int8_split", "int8_split", "rebuild")),
                 Choice("dense", ("dense",) * 5))


def selector(*rows: KernelRow, int8_activations=False) -> KernelSelector:
    return KernelSelector("bfloat16", 2, int8_activations=int8_activations, level="avx2", tuned=(rows, "the test"))


def test_a_weight_takes_the_first_form_its_row_names_with_its_kernels():
    kept = selector(INT8_FIRST).keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert isinstance(kept, Int8Weight) and kept.choice == INT8_FIRST.choices[0]


def test_a_form_the_weight_cannot_be_kept_in_is_skipped():
    candidates = [c for c in int8_and_dense_candidates() if c.form == "dense"]
    kept = selector(INT8_FIRST).keep("Q5_0", SHAPE, candidates)
    assert isinstance(kept, DenseWeight) and kept.choice == Choice("dense", ("dense",) * 5)
    unavailable = [Candidate("int8", lambda: pytest.fail("built"), unavailable="no int8 here"), *candidates]
    assert isinstance(selector(INT8_FIRST).keep("Q5_0", SHAPE, unavailable), DenseWeight)


def test_a_wrong_kernel_passes_its_form_over_for_the_next_with_a_warning(caplog):
    choosing = selector(INT8_FIRST)
    with caplog.at_level(logging.WARNING, logger="candelabra"):
        kept = choosing.keep("Q5_0", SHAPE, int8_and_dense_candidates(broken="int8_split"))
    assert isinstance(kept, DenseWeight)
    assert "int8/int8_split is wrong at 17 rows: NMSE" in caplog.text and "the next form serves" in caplog.text
    (selection,) = choosing.selected.values()
    assert selection.passed_over[0].startswith("int8: int8/int8_split is wrong")
    assert "passed over" in choosing.report()


def test_a_kernel_that_raises_passes_its_form_over():
    kept = selector(INT8_FIRST).keep("Q5_0", SHAPE, int8_and_dense_candidates(failing="int8_mm"))
    assert isinstance(kept, DenseWeight)


def test_a_kernel_the_form_lacks_passes_it_over():
    missing = row(Choice("int8", ("no_such_kernel",) * 5), Choice("dense", ("dense",) * 5))
    problem = check_choice(int8_and_dense_candidates()[0].build(), int8_and_dense_candidates()[0],
                           missing.choices[0], "bfloat16")
    assert problem == "form int8 has no kernel no_such_kernel"
    assert isinstance(selector(missing).keep("Q5_0", SHAPE, int8_and_dense_candidates()), DenseWeight)


def test_each_kernel_is_checked_at_one_row_and_past_the_row_groups_where_it_serves_more():
    calls = []
    candidates = int8_and_dense_candidates()
    build = candidates[0].build

    def counted():
        kept = build()
        real = kept.kernels()
        kept.kernels = lambda: {name: (lambda x, name=name: calls.append((name, x.shape[0])) or real[name](x))
                                for name in real}
        return kept
    candidates[0].build = counted
    choosing = selector(INT8_FIRST)
    choosing.keep("Q5_0", SHAPE, candidates)
    assert sorted(calls) == sorted([("int8_mm", 1), ("int8_mm", CHECKED_ROWS), ("int8_split", CHECKED_ROWS),
                                    ("rebuild", CHECKED_ROWS)])
    calls.clear()
    choosing.keep("Q5_0", SHAPE, candidates)  # the same format and shape: its selection, checked once
    assert calls == []
    choosing.keep("Q5_0", (96, 256), int8_and_dense_candidates(shape=(96, 256)))
    assert len(choosing.selected) == 2


def test_with_int8_activations_a_kernel_that_rounds_x_serves_within_its_budget():
    rounded = row(Choice("int8", ("int8_rounded",) * 5), activations=INT8)
    exact = row(Choice("int8", ("int8_mm",) * 5))
    kept = selector(rounded, exact, int8_activations=True).keep("Q5_0", SHAPE, rounding_candidates())
    assert kept.choice.kernels == ("int8_rounded",) * 5
    assert selector(rounded, exact).keep("Q5_0", SHAPE, rounding_candidates()).choice.kernels == ("int8_mm",) * 5


def test_a_kernel_that_rounds_x_too_coarsely_passes_to_the_exact_row():
    rounded = row(Choice("int8", ("int8_rounded",) * 5), activations=INT8)
    exact = row(Choice("int8", ("int8_mm",) * 5))
    choosing = selector(rounded, exact, int8_activations=True)
    kept = choosing.keep("Q5_0", SHAPE, rounding_candidates(bits=3))
    assert kept.choice.kernels == ("int8_mm",) * 5
    (selection,) = choosing.selected.values()
    assert "int8/int8_rounded is wrong at 1 rows" in selection.passed_over[0]


def test_a_weight_no_form_serves_is_refused_naming_what_was_passed_over():
    only_int8 = row(Choice("int8", ("int8_mm",) * 5))
    candidates = [c for c in int8_and_dense_candidates(broken="int8_mm") if c.form == "int8"]
    with pytest.raises(RuntimeError, match="no kernel serves Q5_0 48x256 in bfloat16.*int8/int8_mm is wrong"):
        selector(only_int8).keep("Q5_0", SHAPE, candidates)


def test_the_report_names_each_weights_form_kernels_and_the_rows_cpu():
    choosing = selector(row(*INT8_FIRST.choices, measured="AMD EPYC, 2 threads"))
    choosing.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    report = choosing.report()
    assert "Q5_0 48x256" in report and "int8_mm int8_mm int8_split int8_split rebuild" in report
    assert "AMD EPYC, 2 threads" in report and "ISA level avx2" in report and "after the tuned one" in report


def test_a_large_weight_is_checked_on_rows_at_both_ends():
    rows = checked_rows(10 * CHECKED_OUTPUTS)
    assert len(rows) == CHECKED_OUTPUTS and rows[0] == 0 and rows[-1] == 10 * CHECKED_OUTPUTS - 1
    assert np.array_equal(checked_rows(100), np.arange(100))


def test_without_a_tuned_table_the_table_in_code_serves_a_real_gguf_weight(tmp_path, monkeypatch):
    from candelabra.backends.torch.quantized import candidates
    from candelabra.core.weights.random_quantized import random_quantized

    monkeypatch.setenv("CANDELABRA_KERNEL_TABLES", str(tmp_path))
    weight = random_quantized(np.random.default_rng(2), "Q6_K", 64, 256)
    choosing = KernelSelector("float32", 2, int8_activations=False)
    kept = choosing.keep("Q6_K", weight.shape, candidates(weight, torch.float32))
    (selection,) = choosing.selected.values()
    assert selection.row in kernel_table.TABLE and kept.form == selection.choice.form
    x = torch.randn(3, 256)
    reference = x.double() @ torch.from_numpy(weight.dequantize()).double().T
    assert torch.allclose(kept.matmul(x).double(), reference, rtol=1e-4, atol=1e-4)
