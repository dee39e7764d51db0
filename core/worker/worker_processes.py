"""This node's tensor-parallel ranks that run as child processes: started, watched, stopped.

Each child is `python -m candelabra.core.worker.rank_process` with its `WorkerSpec` as JSON. A child
never outlives a stopped server: it exits when told to stop or when rank 0's process goes away. (The
kernel's parent-death signal would not do: it follows the thread that started the child, and rank 0
starts its ranks on the engine's thread, which ends before the server tells them to stop.)

A child's stderr passes through this process's, line by line, and its last lines are kept: when a
child exits before it is stopped, what it said last is part of the report.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from candelabra.core.worker.parallel_runner import ParallelFailure
from candelabra.core.worker.rank_process import WorkerSpec

# How many of a dead rank's last lines on stderr the report of its death quotes.
LAST_WORDS_LINES = 8


class RankProcess:
    """One rank in a child process, its stderr passed on to ours by a thread of its own."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.rank = spec.topology.device(spec.local).rank
        self.process = subprocess.Popen([sys.executable, "-m", "candelabra.core.worker.rank_process", spec.to_json()],
                                        stderr=subprocess.PIPE, encoding="utf-8", errors="replace")
        self._last_lines: collections.deque[str] = collections.deque(maxlen=LAST_WORDS_LINES)
        self._relay = threading.Thread(target=self._pass_on_stderr, name=f"candelabra-rank-{self.rank}-stderr",
                                       daemon=True)
        self._relay.start()

    def death(self) -> str | None:
        """How the process ended, with its last lines on stderr; None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        self._relay.join(timeout=2.0)  # the lines it wrote before it exited
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        said = "".join(f"\n    {line}" for line in self._last_lines)
        return f"tensor-parallel rank {self.rank} (process {self.process.pid}) {how}" + (
            f"; its last lines on stderr:{said}" if said else "")

    def stop(self, grace: float) -> None:
        """Wait up to `grace` seconds for it to exit, then end it; then wait for its stderr's last lines."""
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._relay.join(timeout=5.0)  # unless a process the rank started still holds its stderr

    def _pass_on_stderr(self) -> None:
        for line in self.process.stderr:
            self._last_lines.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is closed: keep reading, or the child would block
                pass
        self.process.stderr.close()


class WorkerProcesses:
    """This node's ranks that run as child processes."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.ranks = [RankProcess(spec) for spec in specs]
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    def find_dead(self, wait: float = 2.0) -> str | None:
        """Which worker has exited and how, waiting up to `wait` seconds for one to (a failed collective
        is often seen before the process that caused it is reaped); None if all still run."""
        deadline = time.monotonic() + wait
        while True:
            for rank in self.ranks:
                death = rank.death()
                if death is not None:
                    return death
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def check_running(self) -> None:
        """ParallelFailure saying how, if a worker has exited (while the ranks join, none may)."""
        dead = self.find_dead(wait=0)
        if dead is not None:
            raise ParallelFailure(f"while the ranks were joining, {dead}")

    def watch(self, on_death: Callable[[str], None], every: float = 0.5) -> None:
        """Call `on_death(why)` once, from a thread of its own, if a worker exits before `stop()`."""
        def poll() -> None:
            while not self._watching.wait(every):
                dead = self.find_dead(wait=0)
                if dead is not None:
                    self._watching.set()
                    on_death(dead)
                    return

        self._watcher = threading.Thread(target=poll, name="candelabra-rank-watch", daemon=True)
        self._watcher.start()

    def stop(self, grace: float = 10.0) -> None:
        """Wait up to `grace` seconds for the workers to exit (they were told to), then end them; the
        threads started for them have ended when it returns."""
        self._watching.set()
        for rank in self.ranks:
            rank.stop(grace)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
