"""Level 3: continuous batching on the backend under test gives every request its lone tokens."""

import pytest

from candelabra.conformance.engine_cases import run_engine_case
from candelabra.conformance.harness import NOT_SUPPORTED


def test_engine(engine_case, conformance_run, record_property):
    result = run_engine_case(conformance_run.backend, engine_case, conformance_run.seed_for(engine_case),
                             conformance_run.dtype)
    record_property("candelabra-conformance-engine", result.as_dict())
    if result.status == NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.status != "passed":
        pytest.fail(f"{result.message} [run seed {conformance_run.seed}]", pytrace=False)
