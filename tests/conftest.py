"""Fixtures and hooks for every test; the helpers tests import are in support.py."""

import os
from pathlib import Path

import pytest

from candelabra.core.weights.default_model import default_cache_dir
from candelabra.plugins import installed_plugins
from support import interpret_the_kernels_without_a_gpu

# Under xdist each worker's torch (and every server or rank a test starts) sizes its OpenMP team to all
# the cores, so teams outnumber cores; waiting threads then sleep at once instead of spinning on a core
# another team needs. Set before any test imports torch; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The suite serves from the kernel tables in code: a developer's own tuned tables (`candelabra tune`) would
# change which kernels its tests run, so it reads tuned tables from a folder of its own.
os.environ.setdefault("CANDELABRA_KERNEL_TABLES", str(default_cache_dir() / "kernels-tests"))

# The suite measures the exact kernels unless a test allows int8 activations itself: a developer's own
# CANDELABRA_INT8_ACTIVATIONS=1 would otherwise change what float32 tests hold to 1e-9.
os.environ.pop("CANDELABRA_INT8_ACTIVATIONS", None)

# Files in order of their time on 2 cores, longest first (pytest --durations), collected before the
# rest so that under README's `-n auto --dist loadfile --no-loadscope-reorder` each worker takes a long
# one while the short ones fill the end: with test_cuda_backend.py's 8 minutes started last (xdist's
# own order, by the number of tests), two workers took 33 minutes for 40 minutes of serial work.
LONGEST_FIRST = (
    "test_cuda_compile.py", "test_cuda_backend.py", "test_real_models.py", "test_tensor_parallel_serving.py",
    "test_gguf.py", "test_serve_default_model.py", "test_broken_backend.py", "test_tensor_parallel_model.py",
    "test_torch_backend.py", "test_new_backend.py", "test_gcu_backend.py", "test_cuda_int4_matmul.py",
    "test_metal_backend.py", "test_engine.py", "test_conformance_cpu.py", "test_server.py",
    "test_conformance_models.py", "test_tool_calls_served.py", "test_structured_output.py",
)


def pytest_configure(config):
    """Where the cuda kernels run, chosen once: before collection imports a test module, and so
    before Triton decorates any kernel."""
    interpret_the_kernels_without_a_gpu()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: absent without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker more than there are cores. Many tests spend seconds waiting on a server or a
    rank they started; the extra worker runs another file meanwhile. On 2 cores: 1686 s for the suite
    with three workers, 1767 s with two and less work (2026-11-25)."""
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(LONGEST_FIRST)))


@pytest.fixture(autouse=True)
def fresh_plugin_discovery():
    """Each test sees the entry points installed at that moment."""
    installed_plugins.cache_clear()
    yield
    installed_plugins.cache_clear()


# What a tiny test model's LLM gets unless its call says otherwise: the reference backend, a KV cache of
# 2,048 tokens in float32 (the engine checkpoint's 512 bytes a token), no swap space.
TINY_LLM_DEFAULTS = {"backend": "cpu", "kvcache_mem_gpu": 1, "kvcache_mem_cpu": 0}


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """Builds an `LLM` over a tiny random model: conformance's engine checkpoint written with `seed`
    (one folder per seed for the session), or the checkpoint in `folder`, with TINY_LLM_DEFAULTS for
    every option the call leaves out, so that how a module's engine differs shows where it is built."""
    from candelabra.conformance.engine_cases import write_tiny_checkpoint
    from candelabra.core.llm import LLM

    folders: dict[int, Path] = {}

    def build(seed: int | None = None, *, folder: Path | None = None, **options) -> LLM:
        if (seed is None) == (folder is None):
            raise TypeError("tiny_llm takes a seed or a folder")
        if folder is None:
            if seed not in folders:
                folders[seed] = tmp_path_factory.mktemp(f"tiny-seed-{seed}")
                write_tiny_checkpoint(folders[seed], seed=seed)
            folder = folders[seed]
        return LLM(folder, **{**TINY_LLM_DEFAULTS, **options})

    return build


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """A real `candelabra serve` on 127.0.0.1 (cpu backend) serving a tiny random model with a
    chat template; `.url` and `.model`."""
    from live_server import LiveServer, write_chat_checkpoint

    folder = write_chat_checkpoint(tmp_path_factory.mktemp("served-model"))
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "4",
                    "--kvcache-mem-cpu", "1", "--served-model-name", "tiny-chat") as server:
        yield server


@pytest.fixture(scope="session")
def default_server():
    """A real `candelabra serve` of the default model on the best backend here, shared by the test
    modules that need a real model's answers (tool calls, structured output)."""
    from live_server import LiveServer

    with LiveServer("--backend", "auto", "--kvcache-mem-gpu", "64", "--kvcache-mem-cpu", "0") as server:
        yield server


@pytest.fixture
def user_tables(tmp_path, monkeypatch):
    """The cuda backend's user tables of GEMV tilings in a folder of the test's own, read afresh."""
    from candelabra.backends.cuda.kernels import gemv_tilings

    monkeypatch.setenv("CANDELABRA_KERNEL_TABLES", str(tmp_path / "tables"))
    gemv_tilings.measured_tilings.cache_clear()
    yield tmp_path / "tables" / "cuda"
    gemv_tilings.measured_tilings.cache_clear()
