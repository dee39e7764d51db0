"""Offline generation: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from tqdm import tqdm

from candelabra.core.contract.device import Device
from candelabra.core.engine.engine import EngineConfig, LLMEngine, RequestOutput
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.loading.in_situ import InSituQuantized
from candelabra.core.loading.model import load_model
from candelabra.core.loading.open import open_model
from candelabra.core.loading.quant_flag import check_quant, parse_quant
from candelabra.core.models.offloaded_experts import ExpertOffload
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights import Checkpoint
from candelabra.core.worker.kv_cache_size import blocks_in, device_cache_size, one_block
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.core.worker.parallel_runner import COLLECTIVE_TIMEOUT_SECONDS, ParallelModelRunner
from candelabra.core.worker.rank_process import WorkerSpec
from candelabra.core.worker.topology import Topology
from candelabra.core.worker.worker_processes import WorkerProcesses
from candelabra.plugins import choose_backend

log = logging.getLogger("candelabra")


class LLM:
    """A model on a backend with its engine. `model` is a checkpoint folder or file (safetensors
    folder, .gguf file) or an opened Checkpoint; None serves the default model. `backend` is a
    name, "auto", or a Backend class; `device` one of its devices (an index or a Device; None: 0).

    The KV cache is in `kv_cache_dtype` (default: the compute dtype; "int8" or "fp8" quantizes it, where
    the backend declares that, and as many more blocks fit as its smaller rows allow) and takes `kvcache_mem_gpu`
    MB, or else `kv_fraction` of the backend's free memory (default: the backend's own share),
    never more than `max_num_seqs` sequences of the whole context can fill. `kvcache_mem_cpu` MB
    of host memory hold swapped-out blocks (0: preempt by recompute).

    `load_format` "dummy" loads no weights: random ones in the shapes `model`'s config.json gives
    (a folder holding it, or the file), still quantized in `dummy_quantization` (a GGUF format such
    as "Q4_K") where given; "auto" (the default) loads the checkpoint's own. `isq` (a GGML format:
    "q4k" or "Q4_K", "q8_0", ...) quantizes a dense checkpoint's linear weights into it as they load
    (see `candelabra.core.loading.in_situ`). `eager_steps` runs every step op by op, where the backend
    would capture it (CUDA graphs) or compile it.

    `quant` is candle-vllm's --quant: "gptq", "awq" or "marlin" (either) for a GPTQ or AWQ
    checkpoint, "gguf" for a .gguf one; a checkpoint quantized otherwise is refused, naming both.
    Without it the checkpoint's own quantization is used. A GGML format there ("q4k") means `isq`.

    `num_experts_offload_per_rank` N keeps N of each MoE layer's experts (on each rank) in host
    memory, with `expert_cache_slots` device slots a layer for those recently routed to (default: a
    quarter of N, rounded up); see `candelabra.core.models.offloaded_experts`.

    `topology` with more than one device serves the model tensor-parallel: this process is rank 0, on
    node 0's first device (`device` is then ignored), and starts node 0's other ranks as processes of
    their own; other nodes start theirs with `candelabra serve --node-rank N`. `close()` stops them."""

    def __init__(self, model: str | Path | Checkpoint | None = None, backend: str | type = "auto",
                 device: Device | int | None = None, dtype: str | None = None, kv_cache_dtype: str | None = None,
                 kvcache_mem_gpu: float | None = None, kv_fraction: float | None = None, kvcache_mem_cpu: float = 128,
                 model_id: str | None = None, weight_file: str | None = None, revision: str | None = None,
                 model_type: str | None = None, load_format: str = "auto", dummy_quantization: str | None = None,
                 eager_steps: bool = False, topology: Topology | None = None, num_experts_offload_per_rank: int = 0,
                 expert_cache_slots: int | None = None, quant: str | None = None, isq: str | None = None,
                 **engine_options) -> None:
        quant, isq = parse_quant(quant, isq)
        if isinstance(model, Checkpoint):
            check_quant(quant, model)
            checkpoint = model if isq is None else InSituQuantized(model, isq)
        else:
            checkpoint = open_model(model, model_id, weight_file, revision, load_format, dummy_quantization, quant,
                                    isq)
        self.checkpoint = checkpoint
        offload = (ExpertOffload(num_experts_offload_per_rank, expert_cache_slots)
                   if num_experts_offload_per_rank or expert_cache_slots is not None else None)
        backend_cls = backend if isinstance(backend, type) else choose_backend(backend)
        self.workers, self.communicator, self.backend, self._parallel_runner = None, None, None, None
        try:
            if topology is not None and topology.world_size > 1:
                device = self._start_ranks(topology, backend_cls.name, checkpoint, load_format, dummy_quantization,
                                           dtype, model_type, offload)
            if isinstance(device, int):
                device = Device(device)
            elif device is None and topology is not None:
                device = topology.device(0)  # one device: its NUMA node, where --numa-bind-nodes names one
            self.backend = backend_cls() if device is None else backend_cls(device)
            self.backend.eager_steps = eager_steps
            if self.workers is not None:
                self.communicator = self.backend.communicator(topology.master_addr, topology.master_port,
                                                              COLLECTIVE_TIMEOUT_SECONDS, self.workers.check_running)
            self.model = load_model(checkpoint, self.backend, dtype, model_type, progress=True,
                                    communicator=self.communicator, expert_offload=offload)
            checkpoint.release_pages()
            self.tokenizer = Tokenizer.from_checkpoint(checkpoint, self.model.config.eos_token_ids)
            self.engine = self._engine(kv_cache_dtype, kvcache_mem_gpu, kv_fraction, kvcache_mem_cpu, engine_options)
            _freeze_what_is_loaded()
        except BaseException:
            self._stop(tell_the_ranks=False)
            raise
        self._ids = 0

    def _start_ranks(self, topology: Topology, backend_name: str, checkpoint: Checkpoint, load_format: str,
                     dummy_quantization: str | None, dtype: str | None, model_type: str | None,
                     offload: ExpertOffload | None) -> Device:
        """Start node 0's ranks other than this one, each in a process of its own; this rank's device."""
        if topology.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {topology.node_rank} only runs ranks "
                             "(candelabra serve --node-rank N)")
        isq = checkpoint.format if isinstance(checkpoint, InSituQuantized) else None
        source = dict(backend=backend_name, model=str(checkpoint.path), model_id=None, weight_file=None,
                      revision=None, load_format=load_format, dummy_quantization=dummy_quantization, dtype=dtype,
                      model_type=model_type, topology=topology, isq=isq,
                      num_experts_offload_per_rank=offload.num_offloaded if offload else 0,
                      expert_cache_slots=offload.cache_slots if offload else None)
        self.workers = WorkerProcesses([WorkerSpec(**source, local=local)
                                        for local in range(1, len(topology.device_ids))])
        return topology.device(0)

    def _engine(self, kv_cache_dtype: str | None, kvcache_mem_gpu: float | None, kv_fraction: float | None,
                kvcache_mem_cpu: float, engine_options: dict) -> LLMEngine:
        """The engine over a KV cache sized as the class says, and its model runner (rank 0's, which
        hands every step to the other ranks, under tensor parallelism)."""
        kv_dtype = self.backend.check_kv_cache_dtype(kv_cache_dtype or self.model.dtype, self.model.dtype)
        config = EngineConfig(**self._engine_defaults(engine_options))
        block = one_block(self.model, config.block_size, kv_dtype)
        size = device_cache_size(self.backend, block, kvcache_mem_gpu, kv_fraction, config.max_num_seqs,
                                 config.max_model_len or self.model.config.max_position_embeddings)
        config.num_blocks = size.num_blocks
        config.num_host_blocks = blocks_in(kvcache_mem_cpu, block, "kvcache_mem_cpu") if kvcache_mem_cpu else 0
        if self.communicator is not None:
            runner = self._parallel_runner = ParallelModelRunner(
                self.model, self.communicator, config.num_blocks, config.block_size, kv_dtype,
                find_dead_rank=self.workers.find_dead)
        else:
            runner = ModelRunner(self.model, config.num_blocks, config.block_size, kv_dtype)
        engine = LLMEngine(runner, self.tokenizer, config)
        self.kv_cache_chosen_by = size.chosen_by
        capacity = config.num_blocks * config.block_size
        log.info("KV cache: %d blocks of %d tokens (%d tokens) in %s on %s, sized by %s; %d host blocks",
                 config.num_blocks, config.block_size, capacity, kv_dtype, self.backend.name, size.chosen_by,
                 config.num_host_blocks)
        if capacity < engine.max_model_len:
            log.warning("the KV cache holds %d tokens, fewer than the context of %d: longer requests are refused; "
                        "give it more memory (kvcache_mem_gpu or kv_fraction; --kvcache-mem-gpu, --kv-fraction)",
                        capacity, engine.max_model_len)
        return engine

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they are told to exit, then waited for), and give
        the thread that built the LLM back what its backend changed there (a CPU rank 0's share of
        the cores). The engine cannot step afterwards. Safe to call more than once."""
        self._stop(tell_the_ranks=True)

    def _stop(self, tell_the_ranks: bool) -> None:
        """Leave the group, having told the other ranks to stop (or not, where the constructor failed:
        this node's are then ended at once), and restore the backend's thread settings."""
        workers, self.workers = self.workers, None
        try:
            if workers is not None:
                self._leave_the_group(workers, tell_the_ranks)
        finally:
            if self.backend is not None:
                self.backend.restore_thread_settings()
            gc.unfreeze()  # what this model leaves behind may be collected again

    def _leave_the_group(self, workers: WorkerProcesses, tell_the_ranks: bool) -> None:
        try:
            if tell_the_ranks and self._parallel_runner is not None:
                self._parallel_runner.stop()  # tells the others, then leaves
            elif self.communicator is not None:
                self.communicator.close()
        except Exception as exc:  # noqa: BLE001 - ranks that cannot be told are ended below
            log.warning("could not tell the tensor-parallel ranks to stop: %s", exc)
        finally:
            workers.stop(grace=10.0 if tell_the_ranks else 0.0)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _engine_defaults(self, engine_options: dict) -> dict:
        """`engine_options` with what the user left unset (absent or None) chosen by the backend."""
        options = {name: value for name, value in engine_options.items() if value is not None}
        options.setdefault("reuse_written_blocks_first", self.backend.kv_cache_committed_on_write())
        if options.get("prefill_chunk_size", EngineConfig.prefill_chunk_size):
            options.setdefault("max_num_batched_tokens", self.backend.max_num_batched_tokens())
        return options

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list | None = None,
                 progress: bool = True) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (text, or token id lists)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling parameter sets")
        ids = []
        for prompt, p in zip(prompts, params_list):
            self._ids += 1
            ids.append(f"offline-{self._ids}")
            self.engine.add_request(ids[-1], prompt, p)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="request", disable=not progress) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update()
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **template_kwargs) -> RequestOutput:
        ids = self.tokenizer.chat_token_ids(messages, **template_kwargs)
        return self.generate([ids], params, progress=False)[0]


def _freeze_what_is_loaded() -> None:
    """Keep what exists once the engine is built out of Python's full collections. A full collection scans
    every object the collector tracks, over a million once torch and a model are loaded: one stalled a
    decode step for 110 to 140 ms (once in 1,500 steps of the tiny model here, more often where a step
    allocates more). Those objects live as long as the engine does; garbage is collected first, so that
    none is kept."""
    gc.collect()
    gc.freeze()

