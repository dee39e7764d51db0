"""A wheel built from the repository carries every module, the C kernels' sources and the libraries built from
them for this machine, and the in-tree entry points."""

import subprocess
import sys
import zipfile

import pytest

from candelabra.backends.torch.cpu import kernel_build
from support import REPO

# Top-level folders and the packages they become (pyproject.toml's package-dir).
PACKAGE_DIRS = {"core": "candelabra/core", "plugins": "candelabra/plugins", "backends": "candelabra/backends",
                "conformance": "candelabra/conformance"}


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("candelabra-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    expected = {
        f"{package}/{source.relative_to(REPO / folder).as_posix()}"
        for folder, package in PACKAGE_DIRS.items()
        for pattern in ("*.py", "*.c", "*.h")
        for source in (REPO / folder).rglob(pattern)
        if "__pycache__" not in source.parts
    }
    assert expected, "no sources found"
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel (list their packages in pyproject.toml): {missing}"

    libraries = {f"candelabra/backends/torch/cpu/{variant.library_name}" for variant in kernel_build.variants_for()}
    assert libraries <= names, f"kernel libraries missing from the wheel: {sorted(libraries - names)}"

    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[candelabra]" in text and "cpu = candelabra.backends.cpu.plugin" in text
    assert "candelabra = candelabra.core.cli:main" in text
