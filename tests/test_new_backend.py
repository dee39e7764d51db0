"""`candelabra new-backend`: what it refuses, leaving nothing written, and the packages of both kinds, each
of which installs, passes conformance (a torch device's on the CPU stand-in with its override running, an
array library's with its ops on the host), serves, and passes its own tests."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from candelabra.backends.cpu.ops import NumpyOps
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.cli import main
from candelabra.core.commands.backend_package import ArrayLibrarySpec, NewBackendError, TorchDeviceSpec, write_package
from candelabra.core.contract import OP_NAMES, KVCache
from candelabra.core.contract.step_metadata import plain_sampling
from live_server import LiveServer
from support import REPO, run_candelabra


def scaffold(tmp_path: Path, name: str = "acme", device_type: str = "acmedev", **options) -> Path:
    return write_package(TorchDeviceSpec.with_defaults(name, device_type, **options), tmp_path)


def refused(tmp_path: Path, *args: str) -> str:
    """stderr of `candelabra new-backend ARGS --dir tmp_path`, which must fail and write nothing."""
    result = run_candelabra("new-backend", *args, "--dir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
    return result.stderr


def refused_in_process(capsys, tmp_path: Path, *args: str) -> str:
    """What `refused` checks, through the command's main() in this process."""
    assert main(["new-backend", *args, "--dir", str(tmp_path)]) == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
    return said.err


def test_a_name_that_is_not_a_lowercase_identifier_is_refused(tmp_path):
    said = refused(tmp_path, "Acme", "--torch-device", "acmedev")
    assert "backend name 'Acme' is not a lowercase Python identifier: use a lowercase letter, then lowercase " \
           "letters, digits or underscores" in said
    for name in ("my-npu", "2npu", "_npu", "np u", "npü", ""):
        with pytest.raises(NewBackendError, match="is not a lowercase Python identifier"):
            scaffold(tmp_path, name)
    assert list(tmp_path.iterdir()) == []


def test_a_name_an_installed_backend_has_is_refused_with_the_installed_names(tmp_path):
    said = refused(tmp_path, "gcu", "--torch-device", "acmedev")
    assert "backend name 'gcu' is taken by candelabra " in said
    assert "pick a name no installed backend has (installed: " in said and "cpu, " in said
    for name in ("cpu", "torch"):
        with pytest.raises(NewBackendError, match=f"backend name '{name}' is taken"):
            scaffold(tmp_path, name)
    assert list(tmp_path.iterdir()) == []


def test_the_name_of_an_installed_plugin_that_is_no_backend_is_refused_too(tmp_path):
    with pytest.raises(NewBackendError, match="'models' is the name of an installed candelabra plugin, from "
                                              "candelabra .*a second plugin of that name would not load"):
        scaffold(tmp_path, "models")
    assert list(tmp_path.iterdir()) == []


def test_a_device_type_or_option_that_is_not_a_name_is_refused(tmp_path):
    said = refused(tmp_path, "acme", "--torch-device", "acme-dev")
    assert "--torch-device 'acme-dev' is not an identifier" in said
    for device_type in ("2dev", "acme:0", ""):
        with pytest.raises(NewBackendError, match="--torch-device .* is not an identifier"):
            scaffold(tmp_path, device_type=device_type)
    for options, said in (({"extension": "torch-acme"}, "--extension 'torch-acme' is not a module name"),
                          ({"extension": "vendor..ext"}, "is not a module name"),
                          ({"visible_devices_variable": "ACME DEVICES"}, "is not an environment variable name"),
                          ({"distributed_backend": "acme-ccl"}, "is not a torch.distributed backend name")):
        with pytest.raises(NewBackendError, match=said):
            scaffold(tmp_path, **options)
    assert list(tmp_path.iterdir()) == []


def test_the_kind_of_backend_is_named_exactly_once_and_an_unknown_array_library_is_refused(tmp_path, capsys):
    said = refused(tmp_path, "acme")
    assert "error: say what the backend runs on: --torch-device TYPE for a device with a PyTorch extension" in said
    assert "or --array-library numpy for a device whose runtime hands out arrays of its own" in said
    said = refused_in_process(capsys, tmp_path, "acme", "--torch-device", "acmedev", "--array-library", "numpy")
    assert "--torch-device and --array-library are two kinds of backend; give one" in said
    said = refused_in_process(capsys, tmp_path, "acme", "--array-library", "cupy")
    assert "--array-library 'cupy' is not one the scaffold is written on; it offers numpy" in said
    said = refused_in_process(capsys, tmp_path, "acme", "--array-library", "numpy", "--extension", "torch_acme",
                              "--distributed-backend", "hccl")
    assert "--extension, --distributed-backend belong to --torch-device backends" in said
    with pytest.raises(NewBackendError, match="backend name 'Acme' is not a lowercase Python identifier"):
        write_package(ArrayLibrarySpec("Acme"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_exists_and_is_not_an_empty_folder_is_left_as_it_was(tmp_path):
    target = tmp_path / "candelabra-acme"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    result = run_candelabra("new-backend", "acme", "--torch-device", "acmedev", "--dir", str(tmp_path))
    assert result.returncode == 1 and result.stdout == ""
    assert f"error: {target} already exists and is not empty; remove it, or pass --dir" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["candelabra-acme"]
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"

    (target / "notes.txt").unlink()
    target.rmdir()
    target.write_text("a file")
    with pytest.raises(NewBackendError, match="already exists and is not a folder"):
        scaffold(tmp_path)
    assert target.read_text() == "a file"


def test_a_missing_dir_is_refused_and_not_created(tmp_path):
    missing = tmp_path / "no-such-folder"
    result = run_candelabra("new-backend", "acme", "--torch-device", "acmedev", "--dir", str(missing))
    assert result.returncode == 1
    assert f"error: --dir {missing}: no such folder; create it first" in result.stderr
    assert not missing.exists()


def test_an_existing_empty_target_folder_is_filled(tmp_path):
    (tmp_path / "candelabra-acme").mkdir()
    package = scaffold(tmp_path)
    assert package == tmp_path / "candelabra-acme"
    assert (package / "candelabra_acme" / "backend.py").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["candelabra-acme"], "no staging folder is left"


def test_a_write_that_fails_half_way_leaves_nothing(tmp_path, monkeypatch):
    write_text, written = Path.write_text, []

    def failing_on_the_third(path, *args, **kwargs):
        written.append(path)
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_on_the_third)
    with pytest.raises(NewBackendError, match="cannot write .*candelabra-acme: .*No space left on device; "
                                              "nothing was written"):
        scaffold(tmp_path)
    assert len(written) == 3 and list(tmp_path.iterdir()) == []


def test_the_files_follow_the_options_and_pass_the_repository_lint(tmp_path):
    package = scaffold(tmp_path, "my_npu", "npu", extension="vendor.torch_npu",
                       visible_devices_variable="NPU_DEVICES", distributed_backend="hccl")
    assert package.name == "candelabra-my_npu"
    assert sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()) == [
        "README.md", "candelabra_my_npu/__init__.py", "candelabra_my_npu/backend.py",
        "candelabra_my_npu/overrides.py", "candelabra_my_npu/plugin.py", "candelabra_my_npu/stand_in.py",
        "pyproject.toml", "tests/test_conformance.py"]
    backend = (package / "candelabra_my_npu" / "backend.py").read_text()
    for line in ("class MyNpuBackend(AcceleratorBackend):", 'name = "my_npu"', 'device_type = "npu"',
                 'extension = "vendor.torch_npu"', 'visible_devices_variable = "NPU_DEVICES"',
                 'distributed_backend = "hccl"', 'stand_in_modules = {KERNELS: "candelabra_my_npu.stand_in"}'):
        assert line in backend, line
    assert 'KERNELS = "torch.ops.npu"' in (package / "candelabra_my_npu" / "overrides.py").read_text()
    pyproject = (package / "pyproject.toml").read_text()
    assert 'name = "candelabra-my_npu"' in pyproject and 'my_npu = "candelabra_my_npu.plugin"' in pyproject
    readme = (package / "README.md").read_text()
    for command in ("    pip install -e .", "    CANDELABRA_STAND_IN=npu candelabra conformance --backend my_npu",
                    "    candelabra serve --backend my_npu --weight-path"):
        assert command in readme, command
    assert "docs/writing-a-backend.md" in readme

    defaults = (scaffold(tmp_path) / "candelabra_acme" / "backend.py").read_text()
    for line in ('extension = "torch_acmedev"', 'visible_devices_variable = "ACMEDEV_VISIBLE_DEVICES"',
                 'distributed_backend = "gloo"'):
        assert line in defaults, line

    arrays = write_package(ArrayLibrarySpec("my_rt"), tmp_path)
    assert sorted(str(p.relative_to(arrays)) for p in arrays.rglob("*") if p.is_file()) == [
        "README.md", "candelabra_my_rt/__init__.py", "candelabra_my_rt/backend.py", "candelabra_my_rt/contract.py",
        "candelabra_my_rt/ops.py", "candelabra_my_rt/plugin.py", "pyproject.toml", "tests/test_conformance.py"]
    backend = (arrays / "candelabra_my_rt" / "backend.py").read_text()
    assert "class MyRtBackend(Backend):" in backend and "self.ops = MyRtOps(self)" in backend
    for step in range(1, 4):
        assert f"# DEVICE, step {step}: " in backend, step
    assert "host numpy arrays come in through `to_device`" in backend
    assert "class MyRtOps(Ops):" in (arrays / "candelabra_my_rt" / "ops.py").read_text()
    readme = (arrays / "README.md").read_text()
    steps = ["1. **Memory**", "2. **The KV cache**", "3. **The ops that carry the KV cache**",
             "4. **The ops that read whole weights**", "5. **The rest, one at a time**", "6. **Finding the device**"]
    assert sorted(steps, key=readme.index) == steps
    for command in ('## What "array library" means', "    pip install -e .",
                    "candelabra conformance --backend my_rt --level ops --op array_subset",
                    "candelabra conformance --backend my_rt --level ops --op write_kv"):
        assert command in readme, command

    # The repository's settings, and a vendor's, to whom candelabra is a third-party package.
    for settings in ([], ["--config", "lint.isort.known-first-party = []"]):
        lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                               str(REPO / "pyproject.toml"), *settings, str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.fixture
def array_backend_class(tmp_path, monkeypatch):
    """The backend class of a freshly scaffolded --array-library numpy package, imported from its folder."""
    folder = write_package(ArrayLibrarySpec("halfdev"), tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    yield importlib.import_module("candelabra_halfdev.backend").HalfdevBackend
    for module in [name for name in sys.modules if name.split(".")[0] == "candelabra_halfdev"]:
        del sys.modules[module]


def test_an_array_backend_brings_each_host_result_back_in_the_dtype_it_belongs_in_and_records_it(
        array_backend_class):
    class HalfBackend(array_backend_class):
        dtypes = ("float16", "float32")

    backend, reference, rng = HalfBackend(), NumpyOps(), np.random.default_rng(3)
    q, k, v = (backend.to_device(rng.standard_normal((2, 4, 8)), "float16") for _ in range(3))
    cache = KVCache(backend.zeros((3, 4, 4, 8), "float32"), backend.zeros((3, 4, 4, 8), "float32"))
    positions, slots = backend.to_device(np.array([0, 5], np.int32)), backend.to_device(np.array([1, 6], np.int32))
    cos_sin = backend.to_device(rng.standard_normal((8, 8)), "float32")
    rotated, written = backend.ops.rotary_and_write_kv(q, k, v, positions, cos_sin, cache, slots)
    assert (backend.dtype_of(rotated), backend.dtype_of(written.key), backend.dtype_of(written.value)) == (
        "float16", "float32", "float32")
    host = [a.astype(np.float32) for a in (q, k, v)]
    expected_q, expected_cache = reference.rotary_and_write_kv(*host, positions, cos_sin,
                                                               KVCache(cache.key.copy(), cache.value.copy()), slots)
    np.testing.assert_array_equal(rotated, expected_q.astype(np.float16))
    np.testing.assert_array_equal(written.key, expected_cache.key)
    assert written.key.any() and not cache.key.any(), "the cache came back as a new array, the one passed unchanged"

    logits = backend.to_device(rng.standard_normal((2, 50)), "float16")
    params = backend.prepare_sampling(replace(plain_sampling(0.0, 1.0, np.zeros(2)), num_top_logprobs=3))
    sampled = backend.ops.sample(logits, params)
    assert [backend.dtype_of(part) for part in sampled] == ["int32", "float32", "int32", "float32"]
    np.testing.assert_array_equal(sampled.token_ids, np.argmax(logits, axis=1))
    assert backend.kernel_record() == {"rotary_and_write_kv": "fell back", "sample": "fell back"}
    assert backend.kernel_record() == {}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A package of each kind, written by the console command (acme on the torch device acmedev, acmert on
    numpy) and installed by one pip call into one folder, and a tiny model to serve: where each kind's end
    to end test starts."""
    root = tmp_path_factory.mktemp("scaffolds")
    made = {"acme": run_candelabra("new-backend", "acme", "--torch-device", "acmedev", cwd=root),
            "acmert": run_candelabra("new-backend", "acmert", "--array-library", "numpy", cwd=root)}
    for result in made.values():
        assert result.returncode == 0, result.stderr
    site = root / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                              "--target", str(site), *(str(root / f"candelabra-{name}") for name in made)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    model = root / "model"
    model.mkdir()
    write_tiny_checkpoint(model, seed=5)
    return SimpleNamespace(root=root, made=made, model=model,
                           pythonpath=os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))))


def served_completion_startup(model: Path, backend: str, env: dict) -> str:
    """What `candelabra serve --backend BACKEND` printed as it started, having answered a completion and
    stopped cleanly."""
    with LiveServer("--weight-path", str(model), "--backend", backend, "--kvcache-mem-gpu", "4",
                    "--kvcache-mem-cpu", "1", env=env) as server:
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].strip()
        output = server.stop()
    assert server.process.returncode == 0, output
    return server.startup


def assert_its_own_tests_pass(package: Path, pythonpath: str, basetemp: Path | None = None) -> None:
    """`pytest` in the package's folder passes its one test; `basetemp` keeps what the test wrote."""
    keep = ["--basetemp", str(basetemp)] if basetemp else []
    own_tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *keep], cwd=package,
                               env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True,
                               timeout=900)
    assert own_tests.returncode == 0, own_tests.stdout[-5000:] + own_tests.stderr[-5000:]
    assert "1 passed" in own_tests.stdout


@pytest.mark.slow
def test_a_scaffolded_torch_device_backend_installs_passes_conformance_serves_and_passes_its_own_tests(installed):
    made = installed.made["acme"]
    assert made.stdout.startswith("wrote candelabra-acme: the acme backend on acmedev through torch_acmedev")
    assert "CANDELABRA_STAND_IN=acmedev candelabra conformance --backend acme" in made.stdout
    stand_in = {"PYTHONPATH": installed.pythonpath, "CANDELABRA_STAND_IN": "acmedev"}

    # The ops level, every op, runs in the package's own tests below; here the override's op and one without.
    conformance = run_candelabra("conformance", "--backend", "acme", "--level", "ops", "--op", "silu_and_mul",
                                 "--op", "gelu", "--level", "engine", "--dtype", "float32", env_extra=stand_in)
    assert conformance.returncode == 0, conformance.stdout[-5000:] + conformance.stderr[-5000:]
    assert "stand-in for acmedev" in conformance.stdout
    rows = [line.split() for line in conformance.stdout.splitlines()]
    assert next(row for row in rows if row[:1] == ["op"])[-1] == "kernel"
    kernels = {row[1]: row[-1] for row in rows if row[:1] == ["silu_and_mul"]}
    assert kernels == {"bfloat16": "override", "float32": "override", "float16": "override"}
    assert all(row[-1] != "override" for row in rows if row[:1] == ["gelu"])
    engine = [row for row in rows if row[1:2] in (["passed"], ["failed"])]
    assert engine and all(row[1] == "passed" for row in engine)

    startup = served_completion_startup(installed.model, "acme", stand_in)
    assert "backend   acme on a stand-in for acmedev" in startup
    assert_its_own_tests_pass(installed.root / "candelabra-acme", installed.pythonpath)


@pytest.mark.slow
def test_a_scaffolded_array_backend_installs_serves_and_passes_conformance_with_every_op_on_the_host(
        installed, tmp_path):
    made = installed.made["acmert"]
    assert made.stdout.startswith("wrote candelabra-acmert: the acmert backend on numpy arrays, the host standing in")
    assert "candelabra conformance --backend acmert --level ops" in made.stdout

    startup = served_completion_startup(installed.model, "acmert", {"PYTHONPATH": installed.pythonpath})
    assert "backend   acmert on the host, numpy" in startup and "standing in for the acmert device" in startup

    # The package's own test runs `candelabra conformance --level ops` and keeps its report in its tmp_path.
    assert_its_own_tests_pass(installed.root / "candelabra-acmert", installed.pythonpath, basetemp=tmp_path)
    report, = tmp_path.rglob("conformance.json")
    summary = json.loads(report.read_text())["summary"]
    ops = [op for op in OP_NAMES if op in summary]
    assert ops == list(OP_NAMES), "every op has cases"
    for op in ops:
        assert summary[op]["passed"] == summary[op]["cases"], op
        assert summary[op]["kernels"] == {"fell back": summary[op]["cases"]}, f"{op} runs the reference on the host"
    for call in ("memory", "allocate_kv_cache", "copy_blocks", "swap_out", "swap_in", "array_subset"):
        assert summary[call]["passed"] == summary[call]["cases"] > 0 and summary[call]["kernels"] == {}, call
