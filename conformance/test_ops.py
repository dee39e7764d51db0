"""Level 1: every op of the backend under test against the float64 oracle."""

import pytest

from candelabra.conformance.harness import FAILED, NOT_SUPPORTED, run_case


def test_op(op_case, conformance_run, record_property):
    result = run_case(conformance_run.backend, op_case, conformance_run.seed_for(op_case))
    record_property("candelabra-conformance", result.as_dict())
    if result.status == NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.status == FAILED:
        pytest.fail(f"{result.message} [run seed {conformance_run.seed}]", pytrace=False)
