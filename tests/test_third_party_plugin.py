"""A backend package written by someone else: installed with pip, listed, put through conformance."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support import run_candelabra

PYPROJECT = """
    [build-system]
    requires = ["setuptools>=61"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "candelabra-tinynpu"
    version = "0.3.0"

    [project.entry-points.candelabra]
    tinynpu = "candelabra_tinynpu"
"""

# A vendor's first cut: host memory borrowed from the reference backend, three ops of its own.
PLUGIN = """
    import numpy as np

    from candelabra.backends.cpu import CpuBackend
    from candelabra.core.contract.backend import Probe
    from candelabra.core.contract.ops import Ops
    from candelabra.plugins import hookimpl


    class TinyNpuOps(Ops):
        backend_name = "tinynpu"

        def rms_norm(self, x, weight, eps, weight_offset=0.0):
            scale = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
            return (x * scale * (weight + weight_offset)).astype(np.float32)

        def softmax(self, x):
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)

        def silu_and_mul(self, x):
            half = x.shape[-1] // 2
            gate = x[..., :half]
            return gate / (1 + np.exp(-gate)) * x[..., half:]


    class TinyNpuBackend(CpuBackend):
        name = "tinynpu"

        def __init__(self):
            super().__init__()
            self.ops = TinyNpuOps()

        @classmethod
        def probe(cls):
            return Probe(True, device="tinynpu simulator")


    @hookimpl
    def register_backends(register):
        register(TinyNpuBackend)
"""


def _pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def installed_tinynpu(tmp_path):
    """The package installed into a folder of its own, named on the children's PYTHONPATH: an install into the
    shared environment would show the backend to every test running beside this one."""
    package = tmp_path / "candelabra-tinynpu"
    package.mkdir()
    (package / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (package / "candelabra_tinynpu.py").write_text(textwrap.dedent(PLUGIN))
    site = tmp_path / "site"
    install = _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(site), str(package))
    assert install.returncode == 0, install.stdout + install.stderr
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_installed_third_party_backend_is_listed_and_conformance_runs_on_it(installed_tinynpu, tmp_path):
    listing = run_candelabra("backends", "--json", env_extra=installed_tinynpu)
    assert listing.returncode == 0, listing.stderr
    backends = {b["name"]: b for b in json.loads(listing.stdout)["backends"]}
    assert backends["tinynpu"] == {"name": "tinynpu", "distribution": "candelabra-tinynpu 0.3.0",
                                   "available": True, "priority": 0, "detail": "tinynpu simulator"}
    assert backends["cpu"]["available"]

    results = tmp_path / "tinynpu.json"
    run = run_candelabra("conformance", "--backend", "tinynpu", "--level", "ops", "--json", str(results),
                         env_extra=installed_tinynpu)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "not supported" in run.stdout  # the table

    summary = json.loads(results.read_text())["summary"]
    for op in ("rms_norm", "softmax", "silu_and_mul", "copy_blocks", "array_subset"):
        assert summary[op]["passed"] == summary[op]["cases"] > 0, op
    for op in ("paged_attention", "sample", "linear", "rotary"):
        assert summary[op]["not supported"] == summary[op]["cases"] > 0, op
    assert all(counts["failed"] == 0 for counts in summary.values())
