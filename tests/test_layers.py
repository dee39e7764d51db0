"""The import layers that pyproject.toml declares hold: no module imports one from a layer above its own."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def lint_imports(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT, str(config)], capture_output=True, text=True, cwd=ROOT)


def test_no_module_imports_from_a_layer_above_its_own():
    run = lint_imports(ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "layers KEPT" in run.stdout


def test_an_import_that_points_upwards_breaks_the_layers(tmp_path):
    """With the engine declared below the worker, the engine's use of the model runner points up."""
    declared = (ROOT / "pyproject.toml").read_text()
    swapped = declared.replace('    "candelabra.core.engine",\n    "candelabra.core.worker",\n',
                               '    "candelabra.core.worker",\n    "candelabra.core.engine",\n')
    assert swapped != declared
    config = tmp_path / "pyproject.toml"
    config.write_text(swapped)
    run = lint_imports(config)
    assert run.returncode == 1
    assert "candelabra.core.engine is not allowed to import candelabra.core.worker" in run.stdout
