"""The conformance suite as a pytest plugin.

    pytest -p candelabra.conformance.plugin --pyargs candelabra.conformance --backend NAME

or, the same with a table at the end, `candelabra conformance --backend NAME`. NAME is a
registered backend or "package.module:BackendClass".
"""

from __future__ import annotations

import secrets

import pytest

from candelabra.conformance import report as reporting
from candelabra.conformance.engine_cases import ENGINE_CASES
from candelabra.conformance.harness import case_seed
from candelabra.conformance.model_cases import GGUF_MODEL_CASES, INT4_MODEL_CASES, ISQ_MODEL_CASES, MODEL_CASES
from candelabra.conformance.op_cases import op_cases
from candelabra.conformance.parallel_engine import PARALLEL_ENGINE_CASES
from candelabra.plugins import RegistryError, backend_class


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("candelabra", "candelabra backend conformance")
    group.addoption("--backend", help="backend to test: a registered name or package.module:Class")
    group.addoption("--conformance-op", action="append", default=[], metavar="OP",
                    help="run only the cases of this op (repeatable)")
    group.addoption("--conformance-seed", type=int, default=None, metavar="N",
                    help="base seed of the random inputs; a failure report names the one to reuse")
    group.addoption("--conformance-json", default=None, metavar="FILE", help="also write the results as JSON")
    group.addoption("--conformance-dtype", default=None, metavar="DTYPE",
                    help="compute dtype of the models and engine levels (default: float32)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--backend") is None:
        return
    spec = config.getoption("--backend")
    try:
        cls = backend_class(spec)
    except RegistryError as exc:
        raise pytest.UsageError(str(exc)) from exc
    probe = cls.probe()
    if not probe.available:
        raise pytest.UsageError(f"backend {spec!r} is not available here: {probe.reason}")
    known = {case.op for case in op_cases(cls.dtypes, cls.kv_cache_dtypes)}
    unknown = set(config.getoption("--conformance-op")) - known
    if unknown:
        raise pytest.UsageError(
            f"no conformance cases for {', '.join(sorted(unknown))}; ops are: {', '.join(sorted(known))}"
        )
    dtype = config.getoption("--conformance-dtype") or ("float32" if "float32" in cls.dtypes else cls.dtypes[0])
    if dtype not in cls.dtypes:
        raise pytest.UsageError(f"backend {cls.name!r} does not compute in {dtype}; it offers {', '.join(cls.dtypes)}")
    seed = config.getoption("--conformance-seed")
    state = ConformanceRun(config, cls, probe.detail, secrets.randbits(31) if seed is None else seed, dtype)
    config.pluginmanager.register(state, "candelabra-conformance-run")


def _run(config: pytest.Config) -> ConformanceRun:
    run = config.pluginmanager.get_plugin("candelabra-conformance-run")
    if run is None:
        raise pytest.UsageError("the conformance suite needs --backend NAME")
    return run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op_case" in metafunc.fixturenames:
        cases = _run(metafunc.config).cases()
        metafunc.parametrize("op_case", cases, ids=[c.id for c in cases])
    model_cases = MODEL_CASES + GGUF_MODEL_CASES + INT4_MODEL_CASES + ISQ_MODEL_CASES
    sharded_cases = [case for case in model_cases if getattr(case, "tensor_parallel", True)]
    # fixture -> (cases, whether they compare with transformers); the parallel level reuses the models
    # level's list and most of the engine level's
    named = {"model_case": (model_cases, True), "engine_case": (ENGINE_CASES, False),
             "parallel_model_case": (sharded_cases, True), "parallel_engine_case": (PARALLEL_ENGINE_CASES, False)}
    for fixture, (cases, needs_reference) in named.items():
        if fixture in metafunc.fixturenames:
            _run(metafunc.config)
            if needs_reference:
                _require_reference_stack()
            metafunc.parametrize(fixture, cases, ids=[c.name for c in cases])


def _require_reference_stack() -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise pytest.UsageError(
            f"model conformance compares with transformers on torch, which cannot be imported ({exc}); "
            "install torch and `pip install 'candelabra[dev]'`, or run --level ops"
        ) from exc


@pytest.fixture(scope="session")
def conformance_run(pytestconfig: pytest.Config) -> ConformanceRun:
    return _run(pytestconfig)


class ConformanceRun:
    """The backend under test, the run's base seed, the dtype of its models and engine levels, and
    the results gathered for the table."""

    def __init__(self, config: pytest.Config, cls: type, device: str, seed: int, dtype: str = "float32") -> None:
        self.config, self.backend_class, self.device, self.seed = config, cls, device, seed
        self.dtype = dtype
        self.results: list[dict] = []
        self.model_results: list[dict] = []
        self.engine_results: list[dict] = []
        self.parallel_results: list[dict] = []
        self._backend = None

    @property
    def backend(self):
        if self._backend is None:
            self._backend = self.backend_class()
        return self._backend

    def cases(self) -> list:
        wanted = set(self.config.getoption("--conformance-op"))
        cls = self.backend_class
        return [c for c in op_cases(cls.dtypes, cls.kv_cache_dtypes) if not wanted or c.op in wanted]

    def seed_for(self, case) -> int:
        return case_seed(self.seed, case.name)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            for name, value in report.user_properties:
                if name == "candelabra-conformance":
                    self.results.append(value)
                elif name == "candelabra-conformance-model":
                    self.model_results.append(value)
                elif name == "candelabra-conformance-engine":
                    self.engine_results.append(value)
                elif name == "candelabra-conformance-parallel":
                    self.parallel_results.append(value)

    def pytest_report_header(self) -> str:
        return (f"candelabra conformance: backend {self.backend_class.name} ({self.device}), seed {self.seed}, "
                f"models and engine in {self.dtype}")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not (self.results or self.model_results or self.engine_results or self.parallel_results):
            return
        terminalreporter.write_sep("=", f"conformance of backend {self.backend_class.name!r} ({self.device})")
        if self.results:
            terminalreporter.write_line(reporting.table(self.results))
        if self.model_results:
            terminalreporter.write_line(reporting.model_table(self.model_results))
        if self.engine_results:
            terminalreporter.write_line(reporting.engine_table(self.engine_results))
        if self.parallel_results:
            terminalreporter.write_line(reporting.parallel_table(self.parallel_results))
        terminalreporter.write_line(f"seed {self.seed}: rerun with --seed {self.seed} for the same inputs")
        path = self.config.getoption("--conformance-json")
        if path:
            reporting.write_json(path, self.header(), self.results, self.model_results, self.engine_results,
                                 self.parallel_results)
            terminalreporter.write_line(f"results written to {path}")

    def header(self) -> dict:
        levels = [level for level, results in
                  (("ops", self.results), ("models", self.model_results), ("engine", self.engine_results),
                   ("parallel", self.parallel_results)) if results]
        return {"backend": self.backend_class.name, "device": self.device, "levels": levels, "seed": self.seed,
                "dtype": self.dtype}
