"""The reference backend passes the whole op suite, through the CLI and through plain pytest."""

import json
import subprocess
import sys

import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.op_cases import op_cases
from candelabra.core.contract.ops import OP_NAMES
from support import run_candelabra


@pytest.mark.slow
def test_cpu_passes_every_op_case_with_table_and_json(tmp_path):
    results = tmp_path / "cpu.json"
    run = run_candelabra("conformance", "--backend", "cpu", "--level", "ops", "--json", str(results))

    assert run.returncode == 0, run.stdout + run.stderr
    header = next(line for line in run.stdout.splitlines() if line.startswith("op "))
    assert header.split() == ["op", "dtype", "cases", "passed", "failed", "not", "supported", "worst", "NMSE"]

    document = json.loads(results.read_text())
    assert document["backend"] == "cpu" and document["levels"] == ["ops"]
    dense = [case for case in document["cases"] if not case["weight_format"]]
    quantized = [case for case in document["cases"] if case["weight_format"]]
    assert {case["status"] for case in dense} == {"passed"}
    assert quantized and {case["status"] for case in quantized} == {"not supported"}  # cpu keeps no formats
    assert len(document["cases"]) == len(op_cases(("float32",), CpuBackend.kv_cache_dtypes))
    assert any("kv_dtype=int8" in case["case"] for case in document["cases"])  # the int8 cache it declares
    assert set(OP_NAMES) <= set(document["summary"]), "every op of the contract has cases"


def test_same_seed_draws_the_same_inputs(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        run = run_candelabra("conformance", "--backend", "cpu", "--level", "ops", "--op", "linear", "--seed", "1234",
                             "--json", str(path))
        assert run.returncode == 0, run.stdout + run.stderr
    nmse = [[c["worst_nmse"] for c in json.loads(p.read_text())["cases"]] for p in (first, second)]
    assert nmse[0] == nmse[1]


def test_plain_pytest_invocation_runs_the_suite():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "candelabra.conformance.plugin", "--pyargs",
         "candelabra.conformance.test_ops", "--backend", "cpu", "--conformance-op", "softmax", "-q",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 passed" in run.stdout
    assert "softmax" in run.stdout  # the table at the end


def test_unavailable_or_unknown_backend_is_a_usage_error():
    run = run_candelabra("conformance", "--backend", "nosuch")
    assert run.returncode == 4
    assert "no backend named 'nosuch' is installed" in run.stdout + run.stderr
