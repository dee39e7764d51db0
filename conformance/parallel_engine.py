"""The engine level at tensor parallelism: the same engine cases, on a model whose ranks are this
process (rank 0, running the engine) and child processes started as a server starts them. Of the
MoE cases only the batching one runs here: each case starts its ranks anew (5 to 14 s a case on 2
cores), and what a MoE model adds at tensor parallelism, each rank running its own experts' share of
a batch, is the same in all four. The quantized-cache cases do not run here: a rank's cache is its
heads' share of the one-process cache, written and read by the same ops."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

from candelabra.conformance.engine_cases import ENGINE_CASES, EngineCase, EngineResult, _Harness, run_engine_case
from candelabra.core.contract.backend import Backend

PARALLEL_ENGINE_CASES = [case for case in ENGINE_CASES
                         if (not case.moe or case.check == "staggered-arrivals") and case.kv_cache_dtype is None]


class _ParallelHarness(_Harness):
    """Engines over one tensor-parallel model: rank 0 here, ranks 1 .. W-1 as worker processes that
    follow every engine this harness makes (each is a new cache order to them)."""

    def __init__(self, backend_class: type[Backend], folder: Path, dtype: str, world_size: int) -> None:
        from candelabra.core.engine.tokenizer import Tokenizer
        from candelabra.core.loading.model import load_model
        from candelabra.core.weights.safetensors import SafetensorsCheckpoint
        from candelabra.core.worker.parallel_runner import COLLECTIVE_TIMEOUT_SECONDS
        from candelabra.core.worker.rank_process import WorkerSpec
        from candelabra.core.worker.topology import Topology
        from candelabra.core.worker.worker_processes import WorkerProcesses

        # The workers read the checkpoint while this process goes on: a copy of their own outlives the case's folder.
        self._folder = tempfile.mkdtemp(prefix="candelabra-parallel-engine-")
        shutil.copytree(folder, self._folder, dirs_exist_ok=True)
        topology = Topology(tuple(range(world_size)), master_port=_free_port())
        spec = dict(backend=backend_class.name, model=self._folder, model_id=None, weight_file=None, revision=None,
                    load_format="auto", dummy_quantization=None, dtype=dtype, model_type=None, topology=topology)
        self.workers = WorkerProcesses([WorkerSpec(**spec, local=local) for local in range(1, world_size)])
        self.backend = backend_class(topology.device(0))
        self.communicator = self.backend.communicator(topology.master_addr, topology.master_port,
                                                      COLLECTIVE_TIMEOUT_SECONDS, self.workers.check_running)
        checkpoint = SafetensorsCheckpoint(Path(self._folder))
        self.model = load_model(checkpoint, self.backend, dtype, communicator=self.communicator)
        self.tokenizer = Tokenizer.from_checkpoint(checkpoint)

    def engine(self, **options):
        from candelabra.core.engine.engine import EngineConfig, LLMEngine
        from candelabra.core.worker.parallel_runner import ParallelModelRunner

        config = EngineConfig(**{"num_blocks": 64, "block_size": 16, "async_scheduling": False, **options})
        runner = ParallelModelRunner(self.model, self.communicator, config.num_blocks, config.block_size,
                                     self.model.dtype, find_dead_rank=self.workers.find_dead)
        return LLMEngine(runner, self.tokenizer, config)

    def close(self) -> None:
        try:
            self.communicator.broadcast_object(("stop", None), src=0)
        finally:
            self.communicator.close()
            self.workers.stop()
            shutil.rmtree(self._folder, ignore_errors=True)
            self.backend.restore_thread_settings()  # rank 0 took its share of the cores on this thread


def run_parallel_engine_case(backend_class: type[Backend], case: EngineCase, seed: int, dtype: str = "float32",
                             world_size: int = 2) -> EngineResult:
    """`case` of the engine level, on `backend_class` at tensor parallelism over `world_size` ranks."""
    return run_engine_case(backend_class, case, seed, dtype,
                           make_harness=lambda cls, folder, d: _ParallelHarness(cls, folder, d, world_size))


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]
