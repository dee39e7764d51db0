"""`candelabra new-backend`: what it refuses, leaving nothing written, and a scaffolded package that
installs, passes conformance on the CPU stand-in with its override running, serves, and passes its own tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.commands.backend_package import BackendSpec, NewBackendError, write_package
from live_server import LiveServer
from support import REPO, run_candelabra


def scaffold(tmp_path: Path, name: str = "acme", device_type: str = "acmedev", **options) -> Path:
    return write_package(BackendSpec.with_defaults(name, device_type, **options), tmp_path)


def refused(tmp_path: Path, *args: str) -> str:
    """stderr of `candelabra new-backend ARGS --dir tmp_path`, which must fail and write nothing."""
    result = run_candelabra("new-backend", *args, "--dir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
    return result.stderr


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

    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(REPO / "pyproject.toml"), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.slow
def test_a_scaffolded_backend_installs_passes_conformance_serves_and_passes_its_own_tests(tmp_path):
    made = run_candelabra("new-backend", "acme", "--torch-device", "acmedev", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    package = tmp_path / "candelabra-acme"
    assert made.stdout.startswith(f"wrote {package.name}: the acme backend on acmedev through torch_acmedev")
    assert "CANDELABRA_STAND_IN=acmedev candelabra conformance --backend acme" in made.stdout

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(package)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    stand_in = {"PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))),
                "CANDELABRA_STAND_IN": "acmedev"}

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

    model = tmp_path / "model"
    model.mkdir()
    write_tiny_checkpoint(model, seed=5)
    with LiveServer("--weight-path", str(model), "--backend", "acme", "--kvcache-mem-gpu", "4", "--kvcache-mem-cpu",
                    "1", env=stand_in) as server:
        assert "backend   acme on a stand-in for acmedev" in server.startup
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].strip()
        output = server.stop()
    assert server.process.returncode == 0, output

    own_tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=package,
                               env={**os.environ, "PYTHONPATH": stand_in["PYTHONPATH"]}, capture_output=True,
                               text=True, timeout=900)
    assert own_tests.returncode == 0, own_tests.stdout[-5000:] + own_tests.stderr[-5000:]
    assert "1 passed" in own_tests.stdout
