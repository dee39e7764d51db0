"""This node's tensor-parallel ranks that run as child processes: started, watched, stopped.

Each child is `python -m candelabra.core.worker.rank_process` with its `WorkerSpec` as JSON. A child
never outlives a stopped server: it exits when told to stop or when rank 0's process goes away. (The
kernel's parent-death signal would not do: it follows the thread that started the child, and rank 0
starts its ranks on the engine's thread, which ends before the server tells them to stop.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

from candelabra.core.worker.rank_process import WorkerSpec


class WorkerProcesses:
    """This node's ranks that run as child processes."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        for spec in specs:
            rank = spec.topology.device(spec.local).rank
            self.processes[rank] = subprocess.Popen(
                [sys.executable, "-m", "candelabra.core.worker.rank_process", spec.to_json()])
        self._watching = threading.Event()

    def find_dead(self, wait: float = 2.0) -> str | None:
        """Which worker has exited and how, waiting up to `wait` seconds for one to (a failed collective
        is often seen before the process that caused it is reaped); None if all still run."""
        deadline = time.monotonic() + wait
        while True:
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None:
                    return _death(rank, process, code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self, on_death: Callable[[str], None], every: float = 0.5) -> None:
        """Call `on_death(why)` once, from a thread of its own, if a worker exits before `stop()`."""
        def poll() -> None:
            while not self._watching.wait(every):
                for rank, process in self.processes.items():
                    code = process.poll()
                    if code is not None:
                        self._watching.set()
                        on_death(_death(rank, process, code))
                        return

        threading.Thread(target=poll, name="candelabra-rank-watch", daemon=True).start()

    def stop(self, grace: float = 10.0) -> None:
        """Wait up to `grace` seconds for the workers to exit (they were told to), then end them."""
        self._watching.set()
        for process in self.processes.values():
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _death(rank: int, process: subprocess.Popen, code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"tensor-parallel rank {rank} (process {process.pid}) {how}"
