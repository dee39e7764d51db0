"""Tensor parallelism's processes: one per device. Rank 0 runs the engine (and the server) and hands
every step to the other ranks, which run the same model shard by shard in step with it.

Rank 0's `ParallelModelRunner` broadcasts each `StepOrder` (and the few other calls every rank must
make together: the KV cache's size, warm-up, swap space, stopping) through the backend's
communicator before running it itself; `serve_orders` is the other ranks' loop. A node starts its
own ranks: the first in the calling process, the rest as child processes (`WorkerProcesses`), each
`python -m candelabra.core.worker.tensor_parallel` with its `WorkerSpec` as JSON. A child exits when
told to stop, or when rank 0's process goes away (its next collective fails on the closed
connection), and never outlives a stopped server. (The kernel's parent-death signal would not do:
it follows the thread that started the child, and rank 0 starts its ranks on the engine's thread,
which ends before the server tells them to stop.)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from candelabra.core.contract.dtypes import DType
from candelabra.core.worker.failure import EngineFailure
from candelabra.core.worker.model_runner import ModelRunner, StepOrder
from candelabra.core.worker.topology import Topology

log = logging.getLogger("candelabra")

# Collectives that wait this long for a rank fail: a rank that hangs becomes an error, not a hang.
COLLECTIVE_TIMEOUT_SECONDS = 120.0


class ParallelFailure(EngineFailure):
    """A rank is gone or a collective failed: the ranks are out of step, and the engine cannot go on."""


@dataclass(frozen=True)
class WorkerSpec:
    """All a rank other than 0 needs to load its shard: the backend, the checkpoint as `open_model`
    takes it, the dtype, and where it sits in the topology."""

    backend: str
    model: str | None
    model_id: str | None
    weight_file: str | None
    revision: str | None
    load_format: str
    dummy_quantization: str | None
    dtype: DType | None
    model_type: str | None
    topology: Topology
    local: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        topology = fields.pop("topology")
        topology["device_ids"] = tuple(topology["device_ids"])
        return cls(**fields, topology=Topology(**topology))


@dataclass(frozen=True)
class CacheOrder:
    """The KV cache every rank allocates: rank 0 sizes it from its own free memory."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: DType


class ParallelModelRunner(ModelRunner):
    """Rank 0's model runner: every call that runs the model, or that every rank must make, is
    broadcast to the other ranks first."""

    def __init__(self, model, communicator, num_blocks: int, block_size: int, kv_cache_dtype: DType,
                 find_dead_rank: Callable[[], str | None] = lambda: None) -> None:
        """`find_dead_rank` names a rank that is gone, if any: a failed collective is reported as that."""
        self.communicator, self.find_dead_rank = communicator, find_dead_rank
        self._tell("cache", CacheOrder(num_blocks, block_size, kv_cache_dtype))
        super().__init__(model, num_blocks, block_size, kv_cache_dtype)

    def warm_up(self, max_num_seqs: int) -> None:
        self._tell("warm_up", max_num_seqs)
        super().warm_up(max_num_seqs)

    def allocate_swap_space(self, num_host_blocks: int) -> None:
        self._tell("swap_space", num_host_blocks)
        super().allocate_swap_space(num_host_blocks)

    def run(self, order: StepOrder):
        self._tell("step", order)
        try:
            return super().run(order)
        except Exception as exc:
            raise self._failure("a tensor-parallel step failed", exc) from exc

    def stop(self) -> None:
        """Tell the other ranks to exit, and leave the group."""
        try:
            self._tell("stop", None)
        finally:
            self.communicator.close()

    def _tell(self, what: str, value) -> None:
        try:
            self.communicator.broadcast_object((what, value), src=0)
        except Exception as exc:
            raise self._failure("cannot reach the other tensor-parallel ranks", exc) from exc

    def _failure(self, what: str, exc: Exception) -> ParallelFailure:
        dead = self.find_dead_rank()
        return ParallelFailure(f"{dead}, so the ranks are out of step" if dead else f"{what}: {exc}")


def serve_orders(model, communicator) -> None:
    """A rank other than 0: run what rank 0 broadcasts, in order, until it says stop."""
    runner = None
    while True:
        what, value = communicator.broadcast_object(None, src=0)
        if what == "stop":
            return
        if what == "cache":
            runner = ModelRunner(model, value.num_blocks, value.block_size, value.kv_cache_dtype)
        elif what == "warm_up":
            runner.warm_up(value)
        elif what == "swap_space":
            runner.allocate_swap_space(value)
        elif what == "step":
            runner.run(value)
        else:
            raise ParallelFailure(f"rank 0 sent an order this rank does not know: {what!r}")


def run_worker(spec: WorkerSpec) -> None:
    """The life of a rank other than 0: join the group, load this rank's shard, serve the orders."""
    from candelabra.core.loading.model import load_model
    from candelabra.core.loading.open import open_model
    from candelabra.plugins import choose_backend

    topology = spec.topology
    backend = choose_backend(spec.backend)(topology.device(spec.local))
    communicator = backend.communicator(topology.master_addr, topology.master_port, COLLECTIVE_TIMEOUT_SECONDS)
    try:
        checkpoint = open_model(spec.model, spec.model_id, spec.weight_file, spec.revision, spec.load_format,
                                spec.dummy_quantization)
        model = load_model(checkpoint, backend, spec.dtype, spec.model_type, communicator=communicator)
        checkpoint.release_pages()
        serve_orders(model, communicator)
    finally:
        communicator.close()


class WorkerProcesses:
    """This node's ranks that run as child processes."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        for spec in specs:
            rank = spec.topology.device(spec.local).rank
            self.processes[rank] = subprocess.Popen(
                [sys.executable, "-m", "candelabra.core.worker.tensor_parallel", spec.to_json()])
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


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="rank %(process)d: %(message)s")
    spec = WorkerSpec.from_json(argv[0])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group: rank 0 decides
    try:
        run_worker(spec)
    except Exception as exc:  # noqa: BLE001 - the reason goes to the log; rank 0 reports the rank as gone
        log.error("tensor-parallel rank %d failed: %s", spec.topology.device(spec.local).rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
