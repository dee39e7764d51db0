"""`candelabra tune --backend torch`: the ranking from timings, the measuring loop and the table it writes, with
injected timings: what is tested is the logic, never this machine's clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kernel_candidates import SHAPE, int8_and_dense_candidates, rounding_candidates

from candelabra.backends.torch.cpu.features import usable_cores
from candelabra.backends.torch.kernel_selection import ROUNDED_ACTIVATIONS_NMSE_BUDGET, Candidate
from candelabra.backends.torch.kernel_table import EXACT, INT8, ROW_BANDS, Choice, read_tuned, tuned_rows
from candelabra.backends.torch.kernel_tuning import (
    INVERSION_RATIO,
    PRUNE_RATIO,
    TIMED_CALLS,
    Timing,
    measure,
    rank_forms,
    report,
    summed,
    tune,
)


def timings(table: dict[tuple[str, str], tuple[float | None, ...]], format: str = "Q5_0", shape=SHAPE):
    """Timing rows from {(form, kernel): ms per band, None where not timed}."""
    return [Timing(format, shape, rows, form, kernel, ms=ms)
            for (form, kernel), per_band in table.items() for rows, ms in zip(ROW_BANDS, per_band) if ms is not None]


def test_each_band_runs_its_forms_fastest_kernel():
    (choice,) = rank_forms(timings({
        ("int8", "int8_mm"): (0.14, 0.5, 2.0, 8.0, 32.0),
        ("int8", "int8_split"): (0.4, 0.45, 0.8, 1.9, 6.0),
        ("int8", "rebuild"): (0.9, 0.9, 1.0, 1.5, 3.0),
    }))
    assert choice == Choice("int8", ("int8_mm", "int8_split", "int8_split", "rebuild", "rebuild"))


def test_the_issues_zen4_timings_rank_the_weight_only_kernel_over_onednn():
    """One row of a 4864 x 896 weight on AMD Zen 4: oneDNN packed 189 ms, the int8 weight-only kernel
    0.14 ms, dense bfloat16 0.58 ms (issue 24); packed at 16 rows 2639 ms."""
    ranked = rank_forms(timings({
        ("int8_packed", "onednn"): (189.0, None, 2639.0, None, None),
        ("int8", "int8_mm"): (0.14, 0.3, 1.1, 4.2, 17.0),
        ("int8", "rebuild"): (0.9, 0.95, 1.0, 1.4, 3.5),
        ("dense", "dense"): (0.58, 0.6, 0.7, 1.2, 3.2),
    }))
    assert [c.form for c in ranked] == ["int8", "dense", "int8_packed"]
    assert ranked[0].kernel_for(1) == "int8_mm" and ranked[0].kernel_for(256) == "rebuild"


def test_the_amx_timings_rank_the_packed_weight_first():
    """9728 x 896 on 2 cores with AMX (packed_int8.py): packed 0.44 / 0.42 / 0.55 / 0.97 ms at 1, 4,
    16 and 64 rows, the weight-only kernel 0.70 / 0.94 / 1.71 / 6.7."""
    ranked = rank_forms(timings({
        ("int8_packed", "onednn"): (0.44, 0.42, 0.55, 0.97, 4.0),
        ("int8", "int8_mm"): (0.70, 0.94, 1.71, 6.7, None),
        ("int8", "rebuild"): (1.8, 1.8, 1.5, 1.95, 4.1),
        ("dense", "dense"): (1.0, 1.0, 1.1, 1.6, 4.2),
    }))
    assert ranked[0] == Choice("int8_packed", ("onednn",) * 5)


def test_a_larger_form_ranks_first_only_where_it_is_faster_by_more_than_its_size_costs():
    """Dense bfloat16 holds 2.9 times the bytes of Q5_0's blocks: 10% faster is not enough, 40% is."""
    sizes = {"blocks": 1000, "dense": 2900}
    slightly = timings({("blocks", "blocks_float"): (1.0,) * 5, ("dense", "dense"): (0.9,) * 5})
    assert [c.form for c in rank_forms(slightly, sizes)] == ["blocks", "dense"]
    assert [c.form for c in rank_forms(slightly)] == ["dense", "blocks"]  # sizes unknown: speed alone
    much = timings({("blocks", "blocks_float"): (1.0,) * 5, ("dense", "dense"): (0.6,) * 5})
    assert [c.form for c in rank_forms(much, sizes)] == ["dense", "blocks"]


@pytest.mark.parametrize("slow", ["int8_mm", "int8_split", "rebuild", "dense"])
def test_a_kernel_made_slow_is_never_first(slow):
    table = {("int8", "int8_mm"): (1.0,) * 5, ("int8", "int8_split"): (1.0,) * 5, ("int8", "rebuild"): (1.0,) * 5,
             ("dense", "dense"): (1.0,) * 5}
    table = {key: tuple(ms * (1000 if key[1] == slow else 1 + 0.01 * i) for ms in per_band)
             for i, (key, per_band) in enumerate(table.items())}
    assert slow not in rank_forms(timings(table))[0].kernels


def test_a_form_missing_bands_counts_as_slow_there():
    ranked = rank_forms(timings({
        ("int8_packed", "onednn"): (0.9, None, None, None, None),  # pruned after one band
        ("int8", "int8_mm"): (1.0, 1.0, 1.0, 1.0, 1.0),
    }))
    assert [c.form for c in ranked] == ["int8", "int8_packed"]


def test_a_band_not_timed_follows_the_nearest_band_that_was():
    (choice,) = rank_forms(timings({("int8", "int8_mm"): (1.0, 2.0, None, None, None),
                                    ("int8", "rebuild"): (3.0, 1.0, None, None, None)}))
    assert choice.kernels == ("int8_mm", "rebuild", "rebuild", "rebuild", "rebuild")


def test_dropped_and_untimed_kernels_are_never_ranked():
    rows = timings({("int8", "int8_mm"): (1.0,) * 5})
    rows.append(Timing("Q5_0", SHAPE, 1, "int8", "broken", ms=0.001, dropped="wrong: NMSE 0.3 > 0.0001"))
    rows.append(Timing("Q5_0", SHAPE, 1, "int8_packed", "-", dropped="unavailable"))
    assert rank_forms(rows) == (Choice("int8", ("int8_mm",) * 5),)
    with pytest.raises(ValueError, match="no usable kernel"):
        rank_forms(rows[-2:])


def test_a_formats_shapes_are_summed_where_every_shape_timed_the_kernel():
    first = timings({("int8", "int8_mm"): (1.0, 2.0, None, None, None), ("dense", "dense"): (3.0,) * 5})
    second = timings({("int8", "int8_mm"): (0.5, 0.5, 0.5, None, None), ("dense", "dense"): (1.0,) * 5},
                     shape=(96, 256))
    totals = {(t.form, t.kernel, t.rows): t.ms for t in summed(first + second)}
    assert totals == {("int8", "int8_mm", 1): 1.5, ("int8", "int8_mm", 4): 2.5,
                      **{("dense", "dense", rows): 4.0 for rows in ROW_BANDS}}


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


ALL_FAST = {("int8", "int8_mm"): 1.0, ("int8", "int8_split"): 2.0, ("int8", "rebuild"): 3.0,
            ("int8", "rebuild_f32"): 4.0, ("dense", "dense"): 1.5, ("dense", "dense_f32"): 5.0}


def measured(candidates, times, **kwargs) -> list[Timing]:
    found, _ = measure("Q5_0", SHAPE, candidates, "bfloat16", times, **kwargs)
    return found


def test_every_kernel_is_timed_at_every_band_and_each_forms_size_kept():
    times = FakeTimes(ALL_FAST)
    found, sizes = measure("Q5_0", SHAPE, int8_and_dense_candidates(), "bfloat16", times)
    assert {(t.kernel, t.rows) for t in found} == {(kernel, rows) for _, kernel in ALL_FAST for rows in ROW_BANDS}
    assert sizes == {"int8": SHAPE[0] * SHAPE[1] + 2 * SHAPE[0], "dense": 2 * SHAPE[0] * SHAPE[1]}


def test_a_kernel_with_wrong_results_is_dropped_with_its_error():
    times = FakeTimes({**ALL_FAST, ("int8", "int8_mm"): 0.001})
    found = measured(int8_and_dense_candidates(broken="int8_mm"), times)
    dropped = [t for t in found if t.kernel == "int8_mm"]
    assert dropped and all(t.dropped.startswith("wrong: NMSE") for t in dropped)
    assert "int8_mm" not in rank_forms(found)[0].kernels
    assert times.calls.count(("int8", "int8_mm", 1)) == 1  # its first call is checked, and it goes no further


def test_a_kernel_that_raises_is_dropped_with_its_error():
    found = measured(int8_and_dense_candidates(failing="int8_mm"), FakeTimes(ALL_FAST))
    assert {t.dropped for t in found if t.kernel == "int8_mm"} == {"failed: RuntimeError: no AVX-512"}


def test_a_kernel_far_slower_than_the_best_is_looked_at_again_then_not_timed_at_more_rows():
    times = FakeTimes({**ALL_FAST, ("int8", "int8_split"): 40.0})
    found = measured(int8_and_dense_candidates(), times)
    assert [rows for form, name, rows in times.calls if name == "int8_split"] == [1] * 2 * TIMED_CALLS
    (slow,) = [t for t in found if t.kernel == "int8_split"]
    assert slow.dropped.startswith(f"slow: {40 / 1.0:.0f}x") and 40 > PRUNE_RATIO


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


def test_a_preempted_look_does_not_drop_a_kernel_for_good():
    """Its first calls at one row were held up 30 times its time: looked at again before it is pruned, it
    is timed at every band and ranks first."""
    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=30.0, slow_calls=TIMED_CALLS)
    found = measured(int8_and_dense_candidates(), times)
    (one_row,) = [t for t in found if t.kernel == "int8_mm" and t.rows == 1]
    assert one_row.ms == 1.0 and one_row.usable
    assert rank_forms(found)[0].kernel_for(1) == "int8_mm"


def test_a_kernel_timed_slower_over_one_row_than_over_more_is_timed_again_there():
    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=10.0, slow_calls=TIMED_CALLS)
    found = measured(int8_and_dense_candidates(), times)
    assert times.calls.count(("int8", "int8_mm", 1)) == 2 * TIMED_CALLS
    (one_row,) = [t for t in found if t.kernel == "int8_mm" and t.rows == 1]
    assert one_row.ms == 1.0


def test_a_kernel_slower_over_one_row_every_time_keeps_that_time():
    times = SlowAtOneRow(ALL_FAST, ("int8", "int8_mm"), slow_ms=10.0)
    found = measured(int8_and_dense_candidates(), times)
    (one_row,) = [t for t in found if t.kernel == "int8_mm" and t.rows == 1]
    assert one_row.ms == 10.0 and 10.0 > INVERSION_RATIO * 1.0
    assert times.calls.count(("int8", "int8_mm", 1)) == 2 * TIMED_CALLS  # timed again once, not without end
    assert times.calls.count(("dense", "dense", 1)) == TIMED_CALLS  # no faster over more rows: not again


def test_an_unavailable_form_is_reported_and_never_built():
    candidates = [*int8_and_dense_candidates(),
                  Candidate("int8_packed", lambda: pytest.fail("built"), unavailable="no oneDNN here")]
    found = measured(candidates, FakeTimes(ALL_FAST))
    assert [t.dropped for t in found if t.form == "int8_packed"] == ["no oneDNN here"]


ROUNDED_FASTEST = {**ALL_FAST, ("int8", "int8_rounded"): 0.5}


def test_a_kernel_that_rounds_activations_is_timed_only_when_asked():
    exact = measured(rounding_candidates(), FakeTimes(ROUNDED_FASTEST))
    assert "int8_rounded" not in {t.kernel for t in exact}
    rounding = measured(rounding_candidates(), FakeTimes(ROUNDED_FASTEST), int8_activations=True)
    assert rank_forms(rounding)[0] == Choice("int8", ("int8_rounded",) * 5)


def test_a_kernel_that_rounds_activations_too_coarsely_is_dropped_as_wrong():
    found = measured(rounding_candidates(bits=3), FakeTimes(ROUNDED_FASTEST), int8_activations=True)
    dropped = [t for t in found if t.kernel == "int8_rounded"]
    assert dropped and all(t.dropped.startswith("wrong: NMSE") for t in dropped)
    assert all(ROUNDED_ACTIVATIONS_NMSE_BUDGET < t.nmse < 0.1 for t in dropped)


# the tool, on real weights at a small shape


class Clock:
    """A stopwatch whose times follow the weight's bytes read and the rows: a fixed ranking, whatever the
    machine is doing."""

    def __call__(self, form, name, kernel, x) -> float:
        kernel(x)
        per_row = {"blocks_float": 1.0, "blocks_int8": 0.6, "int8_mm": 1.2, "int4_mm": 0.9}.get(name, 2.0)
        return (0.1 + per_row * x.shape[0]) / 1000


def test_tune_writes_one_row_per_format_and_activations_that_the_table_reads_back(tmp_path):
    from candelabra.backends.torch.cpu.block_products import native_blocks_available

    output = tmp_path / "tuned.json"
    path, tuned = tune(["float32"], ["Q8_0", "Q4_K"], threads=2, shapes=[(64, 256)], output=output,
                       stopwatch=Clock(), repeats=1)
    key, rows = read_tuned(path)
    assert path == output and key["threads"] == "2"
    blocks = native_blocks_available()[0]
    expected = {("Q8_0", EXACT), ("Q4_K", EXACT)} | ({("Q8_0", INT8), ("Q4_K", INT8)} if blocks else set())
    assert {(next(iter(r.formats)), r.activations) for r in rows} == expected
    assert all(r.dtypes == {"float32"} and "candelabra tune" in r.measured for r in rows)
    if blocks:
        (q8,) = [r for r in rows if r.formats == {"Q8_0"} and r.activations == EXACT]
        assert q8.choices[0] == Choice("blocks", ("blocks_float",) * 5)
        (rounded,) = [r for r in rows if r.formats == {"Q8_0"} and r.activations == INT8]
        assert rounded.choices[0] == Choice("blocks", ("blocks_int8",) * 5)
    assert "Q8_0" in report(tuned, 2) and "ms summed" in report(tuned, 2)


def test_the_command_refuses_what_it_cannot_measure_by_name(tmp_path):
    def tune_command(*args):
        return subprocess.run([sys.executable, "-m", "candelabra.core.cli", "tune", *args],
                              capture_output=True, text=True, timeout=120)

    unknown = tune_command("--backend", "torch", "--format", "Q9_9", "--output", str(tmp_path / "t.json"))
    assert unknown.returncode == 2 and "no quantized format Q9_9" in unknown.stderr
    narrow = tune_command("--backend", "torch", "--format", "Q4_K", "--shape", "64x96")
    assert narrow.returncode == 2 and "Q4_K needs K in whole blocks" in narrow.stderr
    bad_shape = tune_command("--backend", "torch", "--shape", "64by96")
    assert bad_shape.returncode == 2 and "give a weight shape as NxK" in bad_shape.stderr
    untunable = tune_command("--backend", "cpu")
    assert untunable.returncode == 2 and "the cpu backend has no kernels to tune" in untunable.stderr
    assert not (tmp_path / "t.json").exists()


def test_the_command_measures_and_writes_the_table_serve_reads(tmp_path):
    done = subprocess.run([sys.executable, "-m", "candelabra.core.cli", "tune", "--backend", "torch", "--format",
                           "Q8_0", "--dtype", "float32", "--shape", "64x256"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CANDELABRA_KERNEL_TABLES": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    (path,) = (tmp_path / "torch-cpu").glob("*.json")
    assert f"written to {path}" in done.stdout and "measuring Q8_0 in float32, x exact" in done.stderr
    assert json.loads(path.read_text())["rows"][0]["formats"] == ["Q8_0"]
    rows, source = tuned_rows(usable_cores(), tmp_path / "torch-cpu")
    assert source == str(path) and rows and all(r.formats == {"Q8_0"} for r in rows)
