"""Level 2: every architecture on the backend under test against transformers, in float32 unless
--dtype says otherwise."""

import pytest

from candelabra.conformance.harness import NOT_SUPPORTED
from candelabra.conformance.model_cases import run_model_case


def test_model(model_case, conformance_run, record_property):
    result = run_model_case(conformance_run.backend, model_case, conformance_run.seed_for(model_case),
                            conformance_run.dtype)
    record_property("candelabra-conformance-model", result.as_dict())
    if result.status == NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.status != "passed":
        pytest.fail(f"{result.message} [run seed {conformance_run.seed}]", pytrace=False)
