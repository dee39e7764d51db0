"""A tensor-parallel rank other than 0, in a process of its own: it joins the group, loads its
shard and runs what rank 0 broadcasts (`parallel_runner.ParallelModelRunner`), in order, until told
to stop. Started as `python -m candelabra.core.worker.rank_process SPEC` with its `WorkerSpec` as
JSON (`worker_processes.WorkerProcesses` does that). It exits when told to stop, or when rank 0's
process goes away (its next collective fails on the closed connection).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from candelabra.core.contract.dtypes import DType
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.core.worker.parallel_runner import COLLECTIVE_TIMEOUT_SECONDS, ParallelFailure, fed_tokens
from candelabra.core.worker.topology import Topology

log = logging.getLogger("candelabra")


@dataclass(frozen=True)
class WorkerSpec:
    """All a rank other than 0 needs to load its shard: the backend, the checkpoint as `open_model`
    takes it, the dtype, where it sits in the topology, and how many experts it keeps in host memory."""

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
    num_experts_offload_per_rank: int = 0
    expert_cache_slots: int | None = None
    isq: str | None = None  # the GGML format a dense checkpoint's linear weights are quantized to at load

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        topology = fields.pop("topology")
        topology["device_ids"] = tuple(topology["device_ids"])
        if topology.get("numa_bind_nodes") is not None:
            topology["numa_bind_nodes"] = tuple(topology["numa_bind_nodes"])
        return cls(**fields, topology=Topology(**topology))


def serve_orders(model, communicator) -> None:
    """A rank other than 0: run what rank 0 broadcasts, in order, until it says stop."""
    runner = previous = None  # previous: this rank's result of the last step, whose tokens the next may take
    while True:
        order, value = communicator.broadcast_object(None, src=0)
        if order == "stop":
            return
        if order == "cache":
            runner, previous = ModelRunner(model, value.num_blocks, value.block_size, value.kv_cache_dtype), None
        elif order == "warm_up":
            runner.warm_up(value)
        elif order == "swap_space":
            runner.allocate_swap_space(value)
        elif order == "release_cached_memory":
            model.backend.release_cached_memory()
        elif order == "step":
            step, feed_rows = value
            previous = runner.run(step, fed_tokens(communicator, feed_rows, previous))
        else:
            raise ParallelFailure(f"rank 0 sent an order this rank does not know: {order!r}")


def run_worker(spec: WorkerSpec, while_waiting: Callable[[], None] | None = None) -> None:
    """The life of a rank other than 0: join the group (calling `while_waiting` while the others have
    not all come, as `Backend.communicator` does), load this rank's shard, serve the orders."""
    from candelabra.core.loading.model import load_model
    from candelabra.core.loading.open import open_model
    from candelabra.core.models.offloaded_experts import ExpertOffload
    from candelabra.plugins import choose_backend

    topology = spec.topology
    backend = choose_backend(spec.backend)(topology.device(spec.local))
    communicator = backend.communicator(topology.master_addr, topology.master_port, COLLECTIVE_TIMEOUT_SECONDS,
                                        while_waiting)
    try:
        checkpoint = open_model(spec.model, spec.model_id, spec.weight_file, spec.revision, spec.load_format,
                                spec.dummy_quantization, isq=spec.isq)
        offload = (ExpertOffload(spec.num_experts_offload_per_rank, spec.expert_cache_slots)
                   if spec.num_experts_offload_per_rank else None)
        model = load_model(checkpoint, backend, spec.dtype, spec.model_type, communicator=communicator,
                           expert_offload=offload)
        checkpoint.release_pages()
        serve_orders(model, communicator)
    finally:
        communicator.close()


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
