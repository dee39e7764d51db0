"""bench/gpu_check.sh's plumbing, which a GPU session of a few minutes depends on: its arguments, the
budget that skips what would start too late, and the one packed file every step leaves behind."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def gpu_check(*arguments: str) -> subprocess.CompletedProcess:
    # the venv's python first on the PATH: the script calls python3
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *arguments], capture_output=True, text=True, timeout=300, env=env)


def test_unknown_steps_and_budgets_that_are_not_seconds_are_refused(tmp_path):
    unknown = gpu_check("--out", str(tmp_path), "benchmark")
    assert unknown.returncode == 2 and "unknown step 'benchmark'" in unknown.stderr

    budget = gpu_check("--out", str(tmp_path), "--budget", "9m", "env")
    assert budget.returncode == 2 and "--budget takes whole seconds, not '9m'" in budget.stderr


def test_a_step_runs_inside_the_budget_and_the_ones_past_it_are_skipped_and_all_is_packed(tmp_path):
    results, pack = tmp_path / "results", tmp_path / "back" / "gpu-check.tgz"
    pack.parent.mkdir()

    ran = gpu_check("--out", str(results), "--budget", "300", "--pack", str(pack), "env")
    late = gpu_check("--out", str(results), "--budget", "1", "--pack", str(pack), "first", "second")

    assert ran.returncode == 0 and late.returncode == 0, ran.stderr + late.stderr
    assert "candelabra" in (results / "env.log").read_text()  # `candelabra backends` ran
    skipped = (results / "skipped.log").read_text().splitlines()
    assert [line.split(":")[0] for line in skipped] == [
        f"== {step}" for step in ("env", "bench-bf16", "bench-unfused", "bench-no-pdl", "profile", "ops",
                                  "models-bf16", "engine", "attention-split", "bench-int4", "profile-no-pdl",
                                  "bench-cublas", "bench-transformers", "bench-in-turn")]
    with tarfile.open(pack) as packed:
        assert {Path(name).name for name in packed.getnames()} >= {"env.log", "skipped.log"}
    assert not pack.with_name("gpu-check.tgz.part").exists()
