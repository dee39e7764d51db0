"""What many test modules share that is not a fixture: where the cuda kernels run, running the real
command, probing a backend without a library, guards against hangs and runaway allocations, resident
memory from /proc/self/smaps, installed distributions made on the fly, a free port, and two
tensor-parallel ranks as threads of one process."""

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from candelabra.backends.cuda.availability import INTERPRETER_VARIABLE, cuda_missing, interpreting
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.plugins import installed_plugins

REPO = Path(__file__).resolve().parent.parent


def interpret_the_kernels_without_a_gpu() -> None:
    """The cuda kernel tests run the kernels on the GPU where torch sees one, and elsewhere on CPU
    tensors through Triton's interpreter: TRITON_INTERPRET=1 for this process where there is no GPU,
    unless the environment already says. Triton reads it when @triton.jit decorates a kernel, which
    is when the kernel's module is imported, and CudaBackend reads it when its class is made: conftest
    calls this before collection imports any test module."""
    import torch

    if INTERPRETER_VARIABLE not in os.environ and cuda_missing(torch):
        os.environ[INTERPRETER_VARIABLE] = "1"


def kernel_device():
    """Where the cuda kernel tests place their tensors: the CPU where Triton interprets the kernels,
    else the first GPU, with its index, as a tensor there names its device (the kernels key the
    buffers they keep by it)."""
    import torch

    return torch.device("cpu") if interpreting() else torch.device("cuda", 0)


def float64_values(tensor) -> np.ndarray:
    """A tensor's values as a float64 numpy array, from the GPU or the CPU."""
    return tensor.detach().double().cpu().numpy()


def skip_where_the_kernels_cannot_run() -> pytest.MarkDecorator:
    """The cuda kernel tests' mark: skipped where there is no GPU and TRITON_INTERPRET, set by whoever
    runs the tests, keeps Triton's interpreter off."""
    import torch

    missing = None if interpreting() else cuda_missing(torch)
    setting = os.environ.get(INTERPRETER_VARIABLE)
    return pytest.mark.skipif(missing is not None, reason=f"{missing} ({INTERPRETER_VARIABLE}={setting!r} here)")


def available_backends() -> list[str]:
    """Every installed backend that can run here, by name, from the plugin registry: tests over
    backends then cover one installed tomorrow too. A backend available only for testing its
    kernels (cuda through the Triton interpreter, priority 1, which conftest sets up without a GPU) is
    left to its own tests: serving a model through an interpreter takes hours."""
    return [registration.name for registration in installed_plugins().backends.registrations()
            if (probe := registration.value.probe()).available and probe.priority > 1]


def probe_without(module: str, backend: str) -> tuple[str, str]:
    """In a fresh interpreter where `module` cannot be imported: what the backend class at
    `backend` ("package.module:Class") answers from probe(), and what constructing it raises."""
    module_path, class_name = backend.split(":")
    script = (
        f"import sys; sys.modules[{module!r}] = None\n"
        f"from {module_path} import {class_name}\n"
        f"probe = {class_name}.probe(); print(probe.available, probe.reason)\n"
        f"try:\n    {class_name}()\nexcept RuntimeError as exc:\n    print('refused:', exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    return first, second


def run_candelabra(*args: str, env_extra: dict | None = None, cwd=None, timeout: float = 600
                   ) -> subprocess.CompletedProcess:
    """The real console command, in a child process, as a user would run it: without TRITON_INTERPRET, which
    the kernel tests may have turned on in this process (a child that needs it says so in `env_extra`).
    `timeout` guards against a hang, far above any machine's time for the work."""
    env = {key: value for key, value in os.environ.items() if key != INTERPRETER_VARIABLE} | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "candelabra.core.cli", *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
    )


@contextlib.contextmanager
def hang_guard(seconds: float):
    """Fails the block with TimeoutError if it runs `seconds`: a guard against hanging, set far above
    any machine's time for the work, never a speed check."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def peak_allocation(limit: int):
    """Fails if the block's Python allocations peak above `limit` bytes: the machine-independent
    sign that a damaged header's sizes were refused, not acted on."""
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < limit, f"allocated {peak} bytes at peak, limit {limit}"


needs_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")


def mapped_resident_kib(path) -> int:
    """KiB of the file `path`'s mapped pages resident in this process, from /proc/self/smaps."""
    return _resident_kib(lambda fields: len(fields) >= 6 and fields[5] == str(path))


def resident_kib_at(address: int, length: int) -> int:
    """KiB resident in this process of the mappings overlapping [address, address + length), from
    /proc/self/smaps: the memory of one allocation, whatever other threads allocate meanwhile."""

    def overlaps(fields: list[str]) -> bool:
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        return start < address + length and address < end

    return _resident_kib(overlaps)


def _resident_kib(chosen) -> int:
    """The Rss of the mappings in /proc/self/smaps whose first line's fields (address range,
    permissions, offset, device, inode, path) `chosen` accepts."""
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields[0].endswith(":"):
                if inside and fields[0] == "Rss:":
                    resident += int(fields[1])
            else:
                inside = chosen(fields)
    return resident


def make_distribution(root: Path, name: str, modules: dict[str, str], entry_points: dict[str, str]) -> Path:
    """A minimal installed distribution under `root` (a dist-info folder next to its modules),
    found by importlib.metadata once `root` is on sys.path."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "\n".join(f"{key} = {value}" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[candelabra]\n{lines}\n")
    return root


def one_line_checkpoint_error(call, *expected: str) -> str:
    """`call()` raises a CheckpointError of one line holding each of `expected`; its message."""
    from candelabra.core.weights import CheckpointError

    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    return message


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (ranks meet there)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


class LoadOnlyCommunicator(Communicator):
    """A rank of a group that never communicates: enough to load a shard, which makes no collective call."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


class BroadcastOnlyRank(Communicator):
    """Rank `rank` of two ranks that are threads of this process, joined by `line` (a queue.Queue):
    rank 0's broadcasts reach rank 1, which is how rank 0 hands the others its orders; a step's
    collectives need the ranks in processes of their own, and are not offered."""

    def __init__(self, rank: int, line: queue.Queue) -> None:
        self.rank, self.world_size, self._line = rank, 2, line

    def broadcast_object(self, obj, src=0):
        if src != 0:
            raise NotImplementedError("only rank 0 broadcasts here")
        if self.rank == 0:
            self._line.put(obj)
            return obj
        return self._line.get(timeout=30)

    def close(self) -> None:
        pass


def prefill_and_decode(model, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    """The prefill's logits for every prompt position, and `steps` greedy tokens decoded after it."""
    block_size = 16
    blocks = list(range(-(-(len(prompt) + steps) // block_size)))
    runner = ModelRunner(model, num_blocks=len(blocks), block_size=block_size)
    prefill = StepMetadata.build([len(prompt)], [len(prompt)], [blocks], block_size,
                                 logits_rows=np.arange(len(prompt)))
    logits = model.backend.to_host(runner.logits(prompt, prefill))
    tokens = [int(np.argmax(logits[-1]))]
    for step in range(1, steps):
        decode = StepMetadata.build([1], [len(prompt) + step], [blocks], block_size)
        next_logits = model.backend.to_host(runner.logits(np.array([tokens[-1]]), decode))
        assert np.isfinite(next_logits).all()
        tokens.append(int(np.argmax(next_logits[0])))
    return logits, tokens
