"""`candelabra conformance`: the pytest suite run in process, ending with the results table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from candelabra.conformance import LEVELS

_SUITES = {level: Path(__file__).with_name(f"test_{name}.py")
           for level, name in (("ops", "ops"), ("models", "models"), ("engine", "engine"), ("parallel", "parallel"))}


def run(
    backend: str,
    levels: Sequence[str] = LEVELS,
    ops: Sequence[str] = (),
    json_path: str | None = None,
    seed: int | None = None,
    dtype: str | None = None,
    pytest_args: Sequence[str] = (),
) -> int:
    """Run the suite's `levels` on `backend`; returns pytest's exit code (0: every case passed
    or was not supported)."""
    args = [str(_SUITES[level]) for level in levels]
    args += ["-p", "candelabra.conformance.plugin", "-p", "no:cacheprovider", "--backend", backend,
             "--rootdir", str(Path(__file__).parent), "-q", "--no-header"]
    args += [arg for op in ops for arg in ("--conformance-op", op)]
    if json_path:
        args += ["--conformance-json", json_path]
    if seed is not None:
        args += ["--conformance-seed", str(seed)]
    if dtype is not None:
        args += ["--conformance-dtype", dtype]
    return int(pytest.main([*args, *pytest_args]))
