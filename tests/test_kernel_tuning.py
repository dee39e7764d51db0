"""Kernels chosen by measurement: the choice from timings, the measuring loop and the table kept per
machine, all with injected timings: what is tested is the logic, never this machine's clock."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from candelabra.backends.torch import kernel_tuning
from candelabra.backends.torch.kernel_tuning import (
    INVERSION_RATIO,
    MAX_LOOKS,
    MEASURING_ORDER,
    PRUNE_RATIO,
    QUIET_MARGIN_CPUS,
    ROW_BANDS,
    TIMED_CALLS,
    Candidate,
    Choice,
    KernelChooser,
    Looks,
    Timing,
    band_index,
    choose,
    describe_cached,
    filled_in,
    format_choices,
    merged,
)
from candelabra.backends.torch.weight_forms import DenseWeight, Int8Weight, KeptWeight

SHAPE = (48, 256)


def timings(table: dict[tuple[str, str], tuple[float | None, ...]], format: str = "Q5_0", shape=SHAPE):
    """Timing rows from {(form, kernel): ms per band, None where not timed}."""
    return [Timing(format, shape, rows, form, kernel, ms=ms)
            for (form, kernel), per_band in table.items() for rows, ms in zip(ROW_BANDS, per_band) if ms is not None]


def test_rows_fall_in_the_nearest_band_in_log_scale():
    assert [ROW_BANDS[band_index(rows)] for rows in (1, 2, 3, 5, 12, 40, 100, 200, 512, 4096)] == \
        [1, 1, 4, 4, 16, 64, 64, 256, 256, 256]


def test_each_band_runs_its_forms_fastest_kernel():
    choice = choose(timings({
        ("int8", "int8_mm"): (0.14, 0.5, 2.0, 8.0, 32.0),
        ("int8", "int8_split"): (0.4, 0.45, 0.8, 1.9, 6.0),
        ("int8", "rebuild"): (0.9, 0.9, 1.0, 1.5, 3.0),
    }))
    assert choice == Choice("int8", ("int8_mm", "int8_split", "int8_split", "rebuild", "rebuild"))


def test_the_issues_zen4_timings_choose_the_weight_only_kernel_over_onednn():
    """One row of a 4864 x 896 weight on AMD Zen 4: oneDNN packed 189 ms, the int8 weight-only kernel
    0.14 ms, dense bfloat16 0.58 ms (issue 24); packed at 16 rows 2639 ms."""
    choice = choose(timings({
        ("int8_packed", "onednn"): (189.0, None, 2639.0, None, None),
        ("int8", "int8_mm"): (0.14, 0.3, 1.1, 4.2, 17.0),
        ("int8", "rebuild"): (0.9, 0.95, 1.0, 1.4, 3.5),
        ("dense", "dense"): (0.58, 0.6, 0.7, 1.2, 3.2),
    }))
    assert choice.form == "int8" and choice.kernel_for(1) == "int8_mm" and choice.kernel_for(256) == "rebuild"


def test_the_amx_timings_choose_the_packed_weight():
    """9728 x 896 on 2 cores with AMX (packed_int8.py): packed 0.44 / 0.42 / 0.55 / 0.97 ms at 1, 4,
    16 and 64 rows, the weight-only kernel 0.70 / 0.94 / 1.71 / 6.7."""
    choice = choose(timings({
        ("int8_packed", "onednn"): (0.44, 0.42, 0.55, 0.97, 4.0),
        ("int8", "int8_mm"): (0.70, 0.94, 1.71, 6.7, None),
        ("int8", "rebuild"): (1.8, 1.8, 1.5, 1.95, 4.1),
        ("dense", "dense"): (1.0, 1.0, 1.1, 1.6, 4.2),
    }))
    assert choice == Choice("int8_packed", ("onednn",) * 5)


@pytest.mark.parametrize("slow", ["int8_mm", "int8_split", "rebuild", "dense"])
def test_a_kernel_made_slow_is_never_chosen(slow):
    table = {("int8", "int8_mm"): (1.0,) * 5, ("int8", "int8_split"): (1.0,) * 5, ("int8", "rebuild"): (1.0,) * 5,
             ("dense", "dense"): (1.0,) * 5}
    table = {key: tuple(ms * (1000 if key[1] == slow else 1 + 0.01 * i) for ms in per_band)
             for i, (key, per_band) in enumerate(table.items())}
    assert slow not in choose(timings(table)).kernels


def test_a_form_missing_bands_counts_as_slow_there():
    choice = choose(timings({
        ("int8_packed", "onednn"): (0.9, None, None, None, None),  # pruned after one band
        ("int8", "int8_mm"): (1.0, 1.0, 1.0, 1.0, 1.0),
    }))
    assert choice.form == "int8"


def test_a_band_not_timed_follows_the_nearest_band_that_was():
    choice = choose(timings({("int8", "int8_mm"): (1.0, 2.0, None, None, None),
                             ("int8", "rebuild"): (3.0, 1.0, None, None, None)}))
    assert choice.kernels == ("int8_mm", "rebuild", "rebuild", "rebuild", "rebuild")


def test_bands_a_weight_was_not_timed_at_take_the_nearest_timed_shape_of_its_format_scaled():
    """Past the budget a weight is timed at one row only; at 64 rows it must not keep the one-row kernel
    where a shape of its format timed there shows the rebuild far faster."""
    full = timings({("int8", "int8_mm"): (1.0, 2.0, 8.0, 32.0, 128.0), ("int8", "rebuild"): (3.0, 3.0, 3.5, 4.0, 8.0)},
                   shape=(4096, 1024))
    other_format = timings({("int8", "int8_mm"): (1.0,) * 5}, format="Q8_0", shape=(1024, 1024))
    farther = timings({("int8", "int8_mm"): (0.1,) * 5}, shape=(64, 64))
    one_row_only = (None,) * 4
    partial = timings({("int8", "int8_mm"): (0.5, *one_row_only), ("int8", "rebuild"): (1.5, *one_row_only)},
                      shape=(2048, 1024))
    rows = filled_in(full + other_format + farther + partial, ("Q5_0", (2048, 1024)))
    assert choose(rows).kernels == ("int8_mm", "int8_mm", "rebuild", "rebuild", "rebuild")
    at_64 = {t.kernel: t for t in rows if t.rows == 64}
    assert at_64["rebuild"].ms == pytest.approx(2.0) and at_64["rebuild"].scaled_from == (4096, 1024)
    assert "~2.000 (as 4096x1024)" in format_choices(full + partial, [("Q5_0", (2048, 1024))])


def test_dropped_and_untimed_kernels_are_never_chosen():
    rows = timings({("int8", "int8_mm"): (1.0,) * 5})
    rows.append(Timing("Q5_0", SHAPE, 1, "int8", "broken", ms=0.001, dropped="wrong: NMSE 0.3 > 0.0001"))
    rows.append(Timing("Q5_0", SHAPE, 1, "int8_packed", "-", dropped="unavailable"))
    assert choose(rows) == Choice("int8", ("int8_mm",) * 5)
    with pytest.raises(ValueError, match="no usable kernel"):
        choose(rows[-2:])


# measuring, with forms whose kernels are real and whose times are injected


class FakeTimes:
    """A stopwatch that calls the kernel and answers the time set for its (form, kernel), counting calls."""

    def __init__(self, ms: dict[tuple[str, str], float]) -> None:
        self.ms = ms
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, form, name, kernel, x) -> float:
        kernel(x)
        self.calls.append((form, name, x.shape[0]))
        return self.ms[(form, name)] / 1000


def int8_and_dense_candidates(rng=None, broken: str | None = None) -> list[Candidate]:
    rng = rng or np.random.default_rng(1)
    values = rng.integers(-127, 128, SHAPE, dtype=np.int8)
    scales = rng.uniform(0.001, 0.01, SHAPE[0]).astype(np.float32)

    def int8() -> Int8Weight:
        kept = Int8Weight.from_rows(values, scales, torch.bfloat16)
        if broken:
            real = kept.kernels

            def kernels():
                found = real()
                found[broken] = lambda x: torch.zeros(x.shape[0], SHAPE[0], dtype=torch.bfloat16) + 1
                return found
            kept.kernels = kernels
        return kept

    dense = lambda: DenseWeight(int8().dense())  # noqa: E731
    return [Candidate("int8", int8), Candidate("dense", dense)]


ALL_FAST = {("int8", "int8_mm"): 1.0, ("int8", "int8_split"): 2.0, ("int8", "rebuild"): 3.0,
            ("int8", "rebuild_f32"): 4.0, ("dense", "dense"): 1.5, ("dense", "dense_f32"): 5.0}


def chooser(tmp_path, stopwatch, budget_s=60.0, dtype="bfloat16", busy_elsewhere: float | None = 0.0,
            machine_cpus=2, **kwargs) -> KernelChooser:
    """A chooser of 2 threads on a machine of `machine_cpus` whose other processes keep `busy_elsewhere` CPUs
    busy while it measures."""
    kwargs.setdefault("int8_activations", False)
    return KernelChooser(dtype, 2, budget_s=budget_s, folder=tmp_path, stopwatch=stopwatch,
                         watch_others=lambda: lambda: busy_elsewhere, machine_cpus=machine_cpus, **kwargs)


def test_the_kept_weight_is_the_chosen_form_with_its_choice(tmp_path):
    times = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 10.0, ("dense", "dense"): 1.0})
    kept = chooser(tmp_path, times).keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert isinstance(kept, DenseWeight) and kept.choice == Choice("dense", ("dense",) * 5)
    assert {rows for _, _, rows in times.calls} == set(ROW_BANDS)


def test_a_kernel_with_wrong_results_is_dropped_with_its_error(tmp_path):
    times = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 0.001})
    measuring = chooser(tmp_path, times)
    kept = measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates(broken="int8_mm"))
    assert "int8_mm" not in kept.choice.kernels
    dropped = [t for t in measuring.timings if t.kernel == "int8_mm"]
    assert dropped and all(t.dropped.startswith("wrong: NMSE") for t in dropped)
    assert times.calls.count(("int8", "int8_mm", 1)) == 1  # its first call is checked, and it goes no further


def test_a_kernel_that_raises_is_dropped_with_its_error(tmp_path):
    candidates = int8_and_dense_candidates()
    build = candidates[0].build

    def failing() -> Int8Weight:
        kept = build()
        real = kept.kernels()
        kept.kernels = lambda: {**real, "int8_mm": lambda x: (_ for _ in ()).throw(RuntimeError("no AVX-512"))}
        return kept
    candidates[0].build = failing
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST))
    measuring.keep("Q5_0", SHAPE, candidates)
    assert {t.dropped for t in measuring.timings if t.kernel == "int8_mm"} == {"failed: RuntimeError: no AVX-512"}


def test_a_kernel_far_slower_than_the_best_is_not_timed_at_more_rows(tmp_path):
    times = FakeTimes({**ALL_FAST, ("int8", "int8_split"): 1000.0})
    measuring = chooser(tmp_path, times)
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert [rows for form, name, rows in times.calls if name == "int8_split"] == [1]
    (slow,) = [t for t in measuring.timings if t.kernel == "int8_split"]
    assert slow.dropped.startswith(f"slow: {1000 / 1.0:.0f}x") and 1000 > PRUNE_RATIO


class SlowAtOneRow(FakeTimes):
    """FakeTimes, but one kernel's calls at one row take `slow_ms` (its first `slow_calls` of them, or all)."""

    def __init__(self, ms, kernel: tuple[str, str], slow_ms: float, slow_calls: int | None = None) -> None:
        super().__init__(ms)
        self.kernel, self.slow_ms, self.slow_calls = kernel, slow_ms, slow_calls

    def __call__(self, form, name, kernel, x) -> float:
        seconds = super().__call__(form, name, kernel, x)
        if (form, name) != self.kernel or x.shape[0] != 1:
            return seconds
        seen = sum(1 for call in self.calls if call == (form, name, 1))
        return self.slow_ms / 1000 if self.slow_calls is None or seen <= self.slow_calls else seconds


def test_a_kernel_timed_slower_over_one_row_than_over_more_is_timed_again_there(tmp_path):
    """Its first look at one row was held up (three calls, 10 ms each, where four rows took 1 ms): taken
    again, it is the fastest there once more."""
    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=10.0, slow_calls=TIMED_CALLS)
    measuring = chooser(tmp_path, times)
    kept = measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert times.calls.count(("int8", "int8_mm", 1)) == 2 * TIMED_CALLS
    (one_row,) = [t for t in measuring.timings if t.kernel == "int8_mm" and t.rows == 1]
    assert one_row.ms == 1.0 and kept.choice.kernel_for(1) == "int8_mm"


def test_a_kernel_slower_over_one_row_every_time_keeps_that_time():
    from candelabra.backends.torch.kernel_tuning import measure

    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=10.0)
    found, _ = measure("Q5_0", SHAPE, int8_and_dense_candidates(), "bfloat16", times, lambda: 1.0)
    (one_row,) = [t for t in found if t.kernel == "int8_mm" and t.rows == 1]
    assert one_row.ms == 10.0 and 10.0 > INVERSION_RATIO * 1.0
    assert times.calls.count(("int8", "int8_mm", 1)) == 2 * TIMED_CALLS  # timed again once, not without end
    assert times.calls.count(("dense", "dense", 1)) == TIMED_CALLS  # no faster over more rows: not again
    # and once the budget is spent on the bands, nothing is timed again
    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=10.0)
    bands_then_nothing = iter([1.0] * (len(MEASURING_ORDER) - 1))
    measure("Q5_0", SHAPE, int8_and_dense_candidates(), "bfloat16", times, lambda: next(bands_then_nothing, 0.0))
    assert {rows for _, name, rows in times.calls if name == "int8_mm"} == set(ROW_BANDS)
    assert times.calls.count(("int8", "int8_mm", 1)) == TIMED_CALLS


def test_an_unavailable_form_is_reported_and_never_built(tmp_path):
    candidates = [*int8_and_dense_candidates(),
                  Candidate("int8_packed", lambda: pytest.fail("built"), unavailable="no oneDNN here")]
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST))
    measuring.keep("Q5_0", SHAPE, candidates)
    assert [t.dropped for t in measuring.timings if t.form == "int8_packed"] == ["no oneDNN here"]


def test_a_cached_table_is_reused_without_timing_anything(tmp_path):
    first = chooser(tmp_path, FakeTimes({**ALL_FAST, ("dense", "dense"): 0.5}))
    first.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    again = FakeTimes(ALL_FAST)
    second = chooser(tmp_path, again)
    kept = second.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert again.calls == [] and kept.form == "dense" and second.spent_s == 0
    assert "all 1 weight shapes from" in second.report()


def test_a_changed_cpu_measures_again(tmp_path, monkeypatch):
    first = chooser(tmp_path, FakeTimes(ALL_FAST))
    first.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    monkeypatch.setattr("candelabra.backends.torch.cpu.features.cpu_model_name", lambda: "Another CPU")
    again = FakeTimes(ALL_FAST)
    other = chooser(tmp_path, again)
    other.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert again.calls and other.path != first.path and other.key["cpu"] == "Another CPU"


@pytest.mark.parametrize("field, value", [("torch", "9.9.9"), ("flags", "0" * 16), ("candidates", "0")])
def test_a_table_kept_for_another_key_is_ignored(tmp_path, field, value):
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST))
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    data = json.loads(measuring.path.read_text())
    data["key"][field] = value
    measuring.path.write_text(json.dumps(data))
    assert chooser(tmp_path, FakeTimes(ALL_FAST)).timings == []


def rounding_candidates(bits: int = 8) -> list[Candidate]:
    """The int8 form with one more kernel, `int8_rounded`, that rounds each row of x to `bits` bits per block
    of 32 before the product, as the GGUF blocks' int8 kernel does with 8."""
    candidates = int8_and_dense_candidates()
    build = candidates[0].build
    largest = 2 ** (bits - 1) - 1

    def rounding() -> Int8Weight:
        kept = build()
        real = kept.kernels()

        def rounded(x):
            blocks = x.float().reshape(x.shape[0], -1, 32)
            scale = blocks.abs().amax(-1, keepdim=True) / largest
            return real["int8_mm"]((torch.round(blocks / scale) * scale).reshape(x.shape).to(x.dtype))
        kept.kernels = lambda: {**real, "int8_rounded": rounded}
        kept.rounds_activations = frozenset({"int8_rounded"})
        return kept
    candidates[0].build = rounding
    return candidates


ROUNDED_FASTEST = {**ALL_FAST, ("int8", "int8_rounded"): 0.5}


def test_a_kernel_that_rounds_activations_is_a_candidate_only_when_allowed(tmp_path):
    exact = chooser(tmp_path, FakeTimes(ROUNDED_FASTEST))
    kept = exact.keep("Q5_0", SHAPE, rounding_candidates())
    assert "int8_rounded" not in kept.choice.kernels
    assert {t.dropped for t in exact.timings if t.kernel == "int8_rounded"} == {
        f"rounds activations to 8 bits: a candidate with {kernel_tuning.INT8_ACTIVATIONS_VARIABLE}=1 only"}

    rounding = chooser(tmp_path, FakeTimes(ROUNDED_FASTEST), int8_activations=True)
    kept = rounding.keep("Q5_0", SHAPE, rounding_candidates())
    assert kept.choice == Choice("int8", ("int8_rounded",) * 5)
    assert "x rounded to int8" in rounding.report()


def test_a_kernel_that_rounds_activations_too_coarsely_is_dropped_as_wrong(tmp_path):
    measuring = chooser(tmp_path, FakeTimes(ROUNDED_FASTEST), int8_activations=True)
    kept = measuring.keep("Q5_0", SHAPE, rounding_candidates(bits=3))
    assert "int8_rounded" not in kept.choice.kernels
    dropped = [t for t in measuring.timings if t.kernel == "int8_rounded"]
    assert dropped and all(t.dropped.startswith("wrong: NMSE") for t in dropped)
    assert all(kernel_tuning.ROUNDED_ACTIVATIONS_NMSE_BUDGET < t.nmse < 0.1 for t in dropped)


def test_tables_measured_with_and_without_rounded_activations_are_kept_apart(tmp_path):
    rounding = chooser(tmp_path, FakeTimes(ROUNDED_FASTEST), int8_activations=True)
    rounding.keep("Q5_0", SHAPE, rounding_candidates())
    again = FakeTimes(ROUNDED_FASTEST)
    exact = chooser(tmp_path, again)
    kept = exact.keep("Q5_0", SHAPE, rounding_candidates())
    assert again.calls and exact.path != rounding.path and "int8-activations" in rounding.path.name
    assert "int8_rounded" not in kept.choice.kernels
    machine = f"2 threads, {exact.key['cpu']}, torch {torch.__version__}"
    described = [d.split(":")[0] for d in describe_cached(tmp_path)]
    assert described == [f"bfloat16, {machine}", f"bfloat16, x rounded to int8, {machine}"]


@pytest.mark.parametrize("value, allowed", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_int8_activations_are_allowed_by_the_environment(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv(kernel_tuning.INT8_ACTIVATIONS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(kernel_tuning.INT8_ACTIVATIONS_VARIABLE, value)
    assert kernel_tuning.int8_activations_from_environment() is allowed
    assert KernelChooser("float32", 2, folder=None).int8_activations is allowed


def test_an_int8_activations_value_that_is_not_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(kernel_tuning.INT8_ACTIVATIONS_VARIABLE, "yes")
    with pytest.raises(ValueError, match="CANDELABRA_INT8_ACTIVATIONS='yes'"):
        kernel_tuning.int8_activations_from_environment()


def test_an_unreadable_table_is_measured_again(tmp_path):
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST))
    measuring.path.parent.mkdir(parents=True, exist_ok=True)
    measuring.path.write_text("{not json")
    again = FakeTimes(ALL_FAST)
    chooser(tmp_path, again).keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert again.calls


def test_past_the_budget_a_new_shape_follows_the_nearest_measured_shape_of_its_format(tmp_path):
    times = FakeTimes({**ALL_FAST, ("dense", "dense"): 0.5})
    measuring = chooser(tmp_path, times, budget_s=0.0)
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())  # a format never measured: measured anyway
    assert [rows for _, _, rows in times.calls] == [1] * len(times.calls)  # only the first band, past the budget
    times.calls.clear()
    wide = (96, 256)
    values = np.random.default_rng(2).integers(-127, 128, wide, dtype=np.int8)
    scales = np.full(wide[0], 0.01, np.float32)
    kept = measuring.keep("Q5_0", wide, [
        Candidate("int8", lambda: Int8Weight.from_rows(values, scales, torch.bfloat16)),
        Candidate("dense", lambda: DenseWeight(Int8Weight.from_rows(values, scales, torch.bfloat16).dense()))])
    assert times.calls == [] and kept.form == "dense" and kept.shape == wide
    assert measuring.used == {("Q5_0", SHAPE): 2}


class SlowTimes(FakeTimes):
    """Each timed call advances the budget's clock by `seconds`, as a large weight's calls take it."""

    def __init__(self, ms, seconds: float) -> None:
        super().__init__(ms)
        self.seconds = seconds
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def __call__(self, form, name, kernel, x) -> float:
        self.now += self.seconds
        return super().__call__(form, name, kernel, x)


def test_one_weight_shape_spends_at_most_its_share_of_the_budget_past_the_first_band(tmp_path):
    times = SlowTimes(ALL_FAST, seconds=0.05)  # 12 calls at one row: 0.6 s, past a quarter of 2 s
    measuring = chooser(tmp_path, times, budget_s=2.0, clock=times.clock)
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert {rows for _, _, rows in times.calls} == {1}
    assert measuring.spent_s < measuring.budget_s  # the rest is left to the other weights


def test_the_report_names_the_chosen_kernel_its_time_and_the_runner_up(tmp_path):
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST))
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    report = measuring.report()
    assert "Q5_0 48x256" in report and "int8/int8_mm" in report and "1.000" in report
    assert "dense/dense 1.500" in report and "measured 1 of 1 weight shapes" in report
    assert describe_cached(tmp_path)[0].startswith("bfloat16, 2 threads, ")


def test_a_budget_that_is_not_a_number_of_seconds_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(kernel_tuning.BUDGET_VARIABLE, "soon")
    with pytest.raises(ValueError, match=kernel_tuning.BUDGET_VARIABLE):
        kernel_tuning.budget_from_environment()
    monkeypatch.setenv(kernel_tuning.BUDGET_VARIABLE, "0.5")
    assert kernel_tuning.budget_from_environment() == 0.5


def test_a_form_without_a_measured_choice_runs_its_default_kernels():
    kept = Int8Weight.from_rows(np.ones(SHAPE, np.int8), np.ones(SHAPE[0], np.float32), torch.bfloat16)
    assert isinstance(kept, KeptWeight) and kept.choice.form == "int8"
    assert kept.matmul(torch.ones(3, SHAPE[1], dtype=torch.bfloat16)).shape == (3, SHAPE[0])


def test_a_weight_chooses_among_its_own_forms_when_its_shape_was_timed_with_others(tmp_path):
    """int8 rows are a candidate only where a weight's values allow them: a later weight of the same
    format and shape without them takes the best of the forms it has."""
    times = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 0.1, ("dense", "dense"): 2.0})
    measuring = chooser(tmp_path, times)
    assert measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates()).form == "int8"
    times.calls.clear()
    only_dense = [c for c in int8_and_dense_candidates() if c.form == "dense"]
    kept = measuring.keep("Q5_0", SHAPE, only_dense)
    assert kept.form == "dense" and kept.choice.kernels == ("dense",) * 5 and times.calls == []


# timings taken while other processes compete for the cores


def test_merged_looks_keep_each_kernels_best_time_and_a_wrong_kernel_stays_dropped():
    earlier = timings({("int8", "int8_mm"): (8.0, 9.0, None, None, None),
                       ("dense", "dense"): (1.0, 2.0, 3.0, 4.0, 5.0)})
    later = timings({("int8", "int8_mm"): (0.4, 16.0, 2.0, None, None),
                     ("dense", "dense"): (1.5, 1.0, 3.5, 4.0, 6.0)})
    wrong = Timing("Q5_0", SHAPE, 1, "dense", "dense_f32", nmse=0.5, dropped="wrong: NMSE 0.5 > 0.0001")
    fast = Timing("Q5_0", SHAPE, 1, "dense", "dense_f32", ms=0.1)
    best = {(t.form, t.kernel, t.rows): t.ms for t in merged([*earlier, fast], [*later, wrong]) if t.usable}
    assert best == {("int8", "int8_mm", 1): 0.4, ("int8", "int8_mm", 4): 9.0, ("int8", "int8_mm", 16): 2.0,
                    ("dense", "dense", 1): 1.0, ("dense", "dense", 4): 1.0, ("dense", "dense", 16): 3.0,
                    ("dense", "dense", 64): 4.0, ("dense", "dense", 256): 5.0}
    assert [t.dropped for t in merged([wrong], [fast])] == [wrong.dropped]


def test_a_weight_measured_under_contention_is_measured_again_until_a_quiet_look_and_keeps_the_best_times(
        tmp_path, caplog):
    # Under contention the two-thread int8 kernel lost a scheduler slice and dense won; quiet, int8 is faster.
    contended = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 16.0, ("dense", "dense"): 1.5})
    first = chooser(tmp_path, contended, busy_elsewhere=0.7)
    assert first.keep("Q5_0", SHAPE, int8_and_dense_candidates()).form == "dense"
    assert first.looks[("Q5_0", SHAPE)] == Looks(1, False, 0.7)
    assert "keep 0.7 CPUs busy" in caplog.text and "measured again by the next start" in first.report()
    contended.calls.clear()
    assert first.keep("Q5_0", SHAPE, int8_and_dense_candidates()).form == "dense"  # not again in one process
    assert contended.calls == []

    quiet = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 0.5, ("dense", "dense"): 2.0})
    second = chooser(tmp_path, quiet)
    kept = second.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert quiet.calls and kept.form == "int8" and kept.choice.kernels == ("int8_mm",) * 5
    assert second.looks[("Q5_0", SHAPE)] == Looks(2, True, 0.0)
    dense = {t.rows: t.ms for t in second.timings if (t.form, t.kernel) == ("dense", "dense")}
    assert dense == dict.fromkeys(ROW_BANDS, 1.5)  # the contended look's faster time, kept

    third = FakeTimes(ALL_FAST)
    assert chooser(tmp_path, third).keep("Q5_0", SHAPE, int8_and_dense_candidates()).form == "int8"
    assert third.calls == []  # settled by the quiet look


def test_a_weight_only_ever_measured_under_contention_is_trusted_after_the_last_look(tmp_path):
    for look in range(1, MAX_LOOKS + 1):
        times = FakeTimes(ALL_FAST)
        measuring = chooser(tmp_path, times, busy_elsewhere=1.0)
        measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
        assert times.calls and measuring.looks[("Q5_0", SHAPE)] == Looks(look, False, 1.0)
    times = FakeTimes(ALL_FAST)
    chooser(tmp_path, times, busy_elsewhere=1.0).keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert times.calls == []


def test_a_contended_weight_is_not_measured_again_past_the_budget(tmp_path):
    chooser(tmp_path, FakeTimes(ALL_FAST), busy_elsewhere=1.0).keep("Q5_0", SHAPE, int8_and_dense_candidates())
    times = FakeTimes(ALL_FAST)
    spent = chooser(tmp_path, times, budget_s=0.0)
    assert spent.keep("Q5_0", SHAPE, int8_and_dense_candidates()).form == "int8" and times.calls == []


@pytest.mark.parametrize("machine_cpus, busy, quiet", [
    (2, QUIET_MARGIN_CPUS, True), (2, QUIET_MARGIN_CPUS + 0.01, False),
    (8, 6 + QUIET_MARGIN_CPUS, True), (8, 6.5, False), (2, None, True)])
def test_a_look_is_quiet_while_others_use_no_more_than_the_cpus_this_process_leaves_free(
        tmp_path, machine_cpus, busy, quiet):
    measuring = chooser(tmp_path, FakeTimes(ALL_FAST), busy_elsewhere=busy, machine_cpus=machine_cpus)
    measuring.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    assert measuring.looks[("Q5_0", SHAPE)].quiet is quiet


def test_weights_another_process_measured_meanwhile_are_kept_when_the_table_is_written(tmp_path):
    one, other = chooser(tmp_path, FakeTimes(ALL_FAST)), chooser(tmp_path, FakeTimes(ALL_FAST))
    one.keep("Q5_0", SHAPE, int8_and_dense_candidates())
    other.keep("Q8_0", SHAPE, int8_and_dense_candidates())
    later = chooser(tmp_path, FakeTimes(ALL_FAST))
    assert {(t.format, t.shape) for t in later.timings} == {("Q5_0", SHAPE), ("Q8_0", SHAPE)}
    assert set(later.looks) == {("Q5_0", SHAPE), ("Q8_0", SHAPE)}


def test_the_tables_live_in_the_caches_kernels_folder_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CANDELABRA_KERNEL_TABLES", raising=False)
    assert kernel_tuning.tables_folder() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("CANDELABRA_KERNEL_TABLES", str(tmp_path / "tables"))
    assert kernel_tuning.tables_folder() == tmp_path / "tables"
    monkeypatch.setattr(kernel_tuning, "_CHOOSERS", {})
    assert kernel_tuning.chooser_for("bfloat16", 2).path.parent == tmp_path / "tables"


def test_the_suite_keeps_its_tables_apart_from_the_ones_serving_reads():
    from candelabra.core.weights.default_model import default_cache_dir

    assert kernel_tuning.tables_folder() != default_cache_dir() / "kernels"
