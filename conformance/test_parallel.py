"""The parallel level (opt-in: it starts processes): at tensor parallelism over two ranks, every model
case gives TP=1's logits and greedy tokens, the collectives are right, and the engine level passes."""

import pytest

from candelabra.conformance.parallel_cases import run_communicator_checks, run_parallel_cases
from candelabra.conformance.parallel_engine import run_parallel_engine_case
from candelabra.core.contract.backend import Backend

WORLD_SIZE = 2


@pytest.fixture(autouse=True)
def _needs_a_communicator(conformance_run):
    if conformance_run.backend_class.communicator is Backend.communicator:
        pytest.skip(f"backend {conformance_run.backend_class.name!r} offers no communicator (Backend.communicator): "
                    "no tensor parallelism")


@pytest.fixture(scope="session")
def parallel_results(conformance_run, request) -> dict:
    """The model cases this run selected (all of them, unless `-k` left some out) at TP=2, run once in
    one group of processes."""
    cases = [item.callspec.params["parallel_model_case"] for item in request.session.items
             if item.originalname == "test_parallel_model"]
    results = run_parallel_cases(_spec(conformance_run), WORLD_SIZE, cases, seed=conformance_run.seed,
                                 dtype=conformance_run.dtype)
    return {result.case: result for result in results}


def test_collectives(conformance_run, record_property):
    results = run_communicator_checks(_spec(conformance_run), WORLD_SIZE, seed=conformance_run.seed)
    for result in results:
        record_property("candelabra-conformance-parallel", {"case": f"collective {result.check}",
                                                            "status": result.status, "detail": result.detail})
    failed = [f"{r.check}: {r.detail}" for r in results if r.status != "passed"]
    if failed:
        pytest.fail("; ".join(failed), pytrace=False)


def test_parallel_model(parallel_model_case, parallel_results, record_property):
    result = parallel_results[parallel_model_case.name]
    record_property("candelabra-conformance-parallel", {"case": f"model {result.case}", "status": result.status,
                                                        "detail": f"NMSE {result.nmse:.2e}, greedy {result.greedy}"
                                                        if result.nmse is not None else result.message})
    if result.status != "passed":
        pytest.fail(result.message, pytrace=False)


def test_parallel_engine(parallel_engine_case, conformance_run, record_property):
    result = run_parallel_engine_case(conformance_run.backend_class, parallel_engine_case,
                                      conformance_run.seed_for(parallel_engine_case), conformance_run.dtype,
                                      WORLD_SIZE)
    record_property("candelabra-conformance-parallel", {"case": f"engine {result.case}", "status": result.status,
                                                        "detail": result.detail or result.message})
    if result.status != "passed":
        pytest.fail(f"{result.message} [run seed {conformance_run.seed}]", pytrace=False)


def _spec(conformance_run) -> str:
    cls = conformance_run.backend_class
    return f"{cls.__module__}:{cls.__qualname__}"
