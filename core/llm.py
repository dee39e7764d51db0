"""Offline generation: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from candelabra.core.engine import EngineConfig, LLMEngine, RequestOutput
from candelabra.core.kv_cache import KVCacheSpec
from candelabra.core.model_runner import ModelRunner
from candelabra.core.models import load_model
from candelabra.core.sampling_params import SamplingParams
from candelabra.core.tokenizer import Tokenizer

log = logging.getLogger("candelabra")

# Preference of `--backend auto`: accelerators first; MLX's CPU build is slower than numpy.
AUTO_ORDER = ("cuda", "gcu", "metal", "cpu")


def choose_backend(name: str = "auto"):
    """The backend class for `name`; "auto" picks the first available, saying why."""
    from candelabra.plugins import backend_class, installed_plugins

    if name != "auto":
        cls = backend_class(name)
        probe = cls.probe()
        if not probe.available:
            raise RuntimeError(f"backend {name!r} is not available: {probe.reason}")
        return cls
    registry = installed_plugins().backends
    passed_over = []
    for candidate in AUTO_ORDER:
        if candidate not in registry:
            passed_over.append(f"{candidate}: not installed")
            continue
        cls = registry.get(candidate)
        probe = cls.probe()
        if probe.available and (candidate != "metal" or probe.device.startswith("gpu")):
            log.info("backend auto: chose %s, on %s (passed over: %s)", candidate, probe.device,
                     "; ".join(passed_over) or "none")
            return cls
        passed_over.append(f"{candidate}: {probe.reason}" if not probe.available else
                           f"{candidate}: runs on {probe.device}, slower than the numpy backend")
    raise RuntimeError("no backend is available: " + "; ".join(passed_over))


def kv_blocks_for(model, block_size: int, memory_mb: float) -> int:
    """How many KV blocks `memory_mb` megabytes hold for this model (--kvcache-mem-gpu/-cpu)."""
    c = model.config
    spec = KVCacheSpec(c.num_layers, 1, block_size, c.num_kv_heads, c.head_dim, model.dtype)
    return spec.with_blocks_for(int(memory_mb * 2**20)).num_blocks


class LLM:
    """A model on a backend with its engine. `model` is a checkpoint folder or file (safetensors
    folder, .gguf file); None serves the default model."""

    def __init__(self, model: str | Path | None = None, backend: str = "auto", dtype: str | None = None,
                 kvcache_mem_gpu: float = 1024, kvcache_mem_cpu: float = 128, model_id: str | None = None,
                 weight_file: str | None = None, revision: str | None = None, model_type: str | None = None,
                 **engine_options) -> None:
        from candelabra.core.default_model import default_model_path
        from candelabra.core.weights.open import open_checkpoint

        if model is None and model_id is None and weight_file is None:
            model = default_model_path()
        path = Path(model) if model is not None else None
        if path is not None and path.is_file() and weight_file is None:
            checkpoint = open_checkpoint(weight_path=path.parent, weight_file=path.name)
        else:
            checkpoint = open_checkpoint(weight_path=path, weight_file=weight_file, model_id=model_id,
                                         revision=revision)
        self.checkpoint = checkpoint
        self.backend = choose_backend(backend)()
        self.model = load_model(checkpoint, self.backend, dtype, model_type, progress=True)
        self.tokenizer = Tokenizer.from_checkpoint(checkpoint, self.model.config.eos_token_ids)
        config = EngineConfig(**engine_options)
        config.num_blocks = kv_blocks_for(self.model, config.block_size, kvcache_mem_gpu)
        config.num_host_blocks = kv_blocks_for(self.model, config.block_size, kvcache_mem_cpu) if kvcache_mem_cpu else 0
        runner = ModelRunner(self.model, config.num_blocks, config.block_size)
        self.engine = LLMEngine(runner, self.tokenizer, config)
        log.info("KV cache: %d blocks of %d tokens (%d tokens) on %s, %d host blocks",
                 config.num_blocks, config.block_size, config.num_blocks * config.block_size,
                 self.backend.name, config.num_host_blocks)
        self._ids = 0

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
