"""The kernel table in code: what it holds, the order a weight reads its rows in, and the tuned table a machine
adds before it."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from candelabra.backends.torch import kernel_table
from candelabra.backends.torch.kernel_table import (
    ANY,
    EXACT,
    INT8,
    INT8_ACTIVATIONS_VARIABLE,
    ISA_LEVELS,
    ROW_BANDS,
    TABLE,
    Choice,
    KernelRow,
    band_index,
    int8_activations_from_environment,
    isa_level,
    levels_from,
    machine_key,
    read_tuned,
    rows_for,
    tuned_file,
    tuned_rows,
    write_tuned,
)
from candelabra.core.contract.weights import QUANTIZED_FORMATS
from candelabra.core.weights.random_quantized import random_quantized


def test_rows_fall_in_the_nearest_band_in_log_scale():
    assert [ROW_BANDS[band_index(rows)] for rows in (1, 2, 3, 5, 12, 40, 100, 200, 512, 4096)] == \
        [1, 1, 4, 4, 16, 64, 64, 256, 256, 256]


def test_a_choice_names_one_kernel_per_band():
    with pytest.raises(ValueError, match="one kernel per band"):
        Choice("dense", ("dense",) * 4)


@pytest.mark.parametrize("flags, level", [
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "amx_tile", "amx_int8", "amx_bf16"},
     "amx"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}, "avx512"),
    ({"avx2", "fma", "f16c", "amx_tile", "amx_int8", "amx_bf16"}, "avx2"),
    ({"avx2", "fma", "f16c"}, "avx2"),
    ({"sse4_2"}, "portable"),
])
def test_the_isa_level_is_the_best_variant_the_flags_run_with_amx_above_avx512(flags, level, monkeypatch):
    monkeypatch.setattr(kernel_table.kernel_build, "machine", lambda: "x86_64")
    assert isa_level(frozenset(flags)) == level


def test_a_cpu_no_variant_runs_on_reads_the_rows_of_any(monkeypatch):
    monkeypatch.setattr(kernel_table.kernel_build, "machine", lambda: "riscv64")
    assert isa_level(frozenset()) == ANY and levels_from(ANY) == (ANY,)


def test_a_level_passes_to_the_levels_below_it():
    assert levels_from("avx512") == ISA_LEVELS[ISA_LEVELS.index("avx512"):] and levels_from("avx512")[-1] == ANY


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("format", QUANTIZED_FORMATS)
def test_every_format_and_dtype_has_a_row_on_every_level_that_ends_in_dense(format, dtype):
    for level in ISA_LEVELS:
        rows = rows_for(format, dtype, EXACT, level)
        assert rows and rows[-1].isa == ANY
        assert any(c.form == "dense" for c in rows[-1].choices)


def test_every_row_is_written_for_levels_the_table_knows_and_names_its_cpu():
    for row in TABLE:
        assert row.isa in ISA_LEVELS and row.activations in (EXACT, INT8) and row.measured
        assert row.formats <= set(QUANTIZED_FORMATS) and row.dtypes <= {"float32", "bfloat16", "float16"}
        assert len({c.form for c in row.choices}) == len(row.choices), row


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("format", QUANTIZED_FORMATS)
def test_every_kernel_a_row_names_is_one_its_form_has(format, dtype):
    """Built from a real weight of the format: a row naming a kernel its form lacks in that dtype (rebuild_f32 in
    float32, say) would pass that form over on every machine."""
    from candelabra.backends.torch.quantized import candidates

    weight = random_quantized(np.random.default_rng(5), format, 32, 256)
    built = {c.form: c.build() for c in candidates(weight, getattr(torch, dtype)) if not c.unavailable}
    for row in TABLE:
        if not row.holds(format, dtype, row.activations):
            continue
        for choice in row.choices:
            if choice.form in built:
                missing = set(choice.kernels) - set(built[choice.form].kernels())
                assert not missing, f"{row.isa} {format} {dtype}: {choice.form} has no {missing}"


def test_with_int8_activations_the_rows_that_round_x_come_before_the_exact_ones():
    for level in ISA_LEVELS:
        rows = rows_for("Q5_0", "bfloat16", INT8, level)
        kinds = [row.activations for row in rows]
        assert kinds == sorted(kinds, key=lambda kind: kind != INT8) and EXACT in kinds
        assert INT8 not in [row.activations for row in rows_for("Q5_0", "bfloat16", EXACT, level)]


def a_row(format="Q5_0", dtype="float32", activations=EXACT, measured="a test") -> KernelRow:
    return KernelRow(frozenset({format}), frozenset({dtype}), "avx2", (Choice("dense", ("dense",) * 5),), measured,
                     activations)


def test_a_machines_tuned_rows_come_before_the_table_in_code():
    tuned = (a_row(measured="tuned"), a_row(format="Q8_0", measured="other format"))
    rows = rows_for("Q5_0", "float32", EXACT, "avx2", tuned)
    assert rows[0].measured == "tuned" and [r.measured for r in rows].count("other format") == 0
    assert rows[1:] == rows_for("Q5_0", "float32", EXACT, "avx2")


def test_a_tuned_table_is_read_back_as_written(tmp_path):
    rows = [a_row(), a_row(format="Q4_K", dtype="bfloat16", activations=INT8)]
    path = tmp_path / "tuned.json"
    write_tuned(path, {"cpu": "a CPU"}, rows)
    assert read_tuned(path) == ({"cpu": "a CPU"}, tuple(rows))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", [
    lambda data: "not json{",
    lambda data: json.dumps({**data, "rows": [{**data["rows"][0], "isa": "avx9000"}]}),
    lambda data: json.dumps({**data, "rows": [{**data["rows"][0], "activations": "int4"}]}),
    lambda data: json.dumps({**data, "rows": [{**data["rows"][0], "choices": [{"form": "dense", "kernels": ["x"]}]}]}),
    lambda data: json.dumps({"key": data["key"]}),
])
def test_a_file_that_is_not_a_tuned_table_is_refused_by_name(tmp_path, damage):
    path = tmp_path / "tuned.json"
    write_tuned(path, {"cpu": "a CPU"}, [a_row()])
    path.write_text(damage(json.loads(path.read_text())))
    with pytest.raises(ValueError, match="is not a tuned kernel table.*candelabra tune --backend torch"):
        read_tuned(path)


def test_serve_reads_the_table_tuned_for_this_machine_and_thread_count(tmp_path):
    assert tuned_rows(2, tmp_path) == ((), "no tuned table")
    write_tuned(tuned_file(machine_key(2), tmp_path), machine_key(2), [a_row()])
    rows, source = tuned_rows(2, tmp_path)
    assert rows == (a_row(),) and source.endswith(".json")
    assert tuned_rows(3, tmp_path) == ((), "no tuned table")


def test_a_table_tuned_for_another_cpu_or_torch_is_left_out(tmp_path):
    key = machine_key(2)
    write_tuned(tuned_file(key, tmp_path), {**key, "torch": "9.9.9"}, [a_row()])
    rows, source = tuned_rows(2, tmp_path)
    assert rows == () and "tuned for another machine" in source


def test_an_unreadable_tuned_table_is_logged_and_the_table_in_code_serves(tmp_path, caplog):
    tuned_file(machine_key(2), tmp_path).write_text("{")
    with caplog.at_level(logging.WARNING, logger="candelabra"):
        rows, source = tuned_rows(2, tmp_path)
    assert rows == () and "unreadable" in source
    assert "is not a tuned kernel table" in caplog.text and "serving from the table in code" in caplog.text


def test_the_tuned_tables_live_in_the_caches_kernels_folder_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("CANDELABRA_KERNEL_TABLES", raising=False)
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path))
    assert kernel_table.tables_folder() == tmp_path / "kernels" / "torch-cpu"
    monkeypatch.setenv("CANDELABRA_KERNEL_TABLES", str(tmp_path / "elsewhere"))
    assert kernel_table.tables_folder() == tmp_path / "elsewhere" / "torch-cpu"


@pytest.mark.parametrize("value, allowed", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_int8_activations_are_allowed_by_the_environment(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv(INT8_ACTIVATIONS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(INT8_ACTIVATIONS_VARIABLE, value)
    assert int8_activations_from_environment() is allowed


def test_an_int8_activations_value_that_is_not_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(INT8_ACTIVATIONS_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{INT8_ACTIVATIONS_VARIABLE}='yes'"):
        int8_activations_from_environment()


def test_the_rows_this_cpu_reads_are_described_with_their_cpu():
    described = "\n".join(kernel_table.describe())
    assert f"ISA level {isa_level()}" in described and "measured" in described
