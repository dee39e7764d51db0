"""The engine: text or token ids in, text and tokens out, one step at a time.

`LLMEngine` checks and tokenizes requests, steps the `EngineCore` (schedule, run, update) and turns
its tokens into each request's text with an `OutputProcessor`, finishing in the core the samples
whose stop strings appear. The async engine steps the same core on a thread of its own and runs the
output processing on the consumers' side instead.
"""

from __future__ import annotations

from candelabra.core.engine.core import CheckedRequest, EngineConfig, EngineCore, EngineOutput
from candelabra.core.engine.output_processor import CompletionOutput, OutputProcessor, RequestOutput
from candelabra.core.engine.pooling import PooledOutput
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.structured_output import GrammarCompiler
from candelabra.core.worker.model_runner import ModelRunner

__all__ = ["CheckedRequest", "CompletionOutput", "EngineConfig", "EngineOutput", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.backend, self.model = runner.backend, runner.model
        if config.max_model_len is not None and config.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), got "
                             f"{config.max_model_len}")
        if config.max_gen_tokens is not None and config.max_gen_tokens < 1:
            raise ValueError(f"max_gen_tokens must be at least 1, got {config.max_gen_tokens}")
        self.max_model_len = config.max_model_len or self.model.config.max_position_embeddings
        if not config.prefill_chunk_size and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must hold a "
                f"whole prompt of up to max_model_len ({self.max_model_len}) tokens")
        if config.num_host_blocks and runner.num_host_blocks != config.num_host_blocks:
            runner.allocate_swap_space(config.num_host_blocks)
        self.core = EngineCore(runner, config, tokenizer.eos_token_ids)
        self.processors: dict[str, OutputProcessor] = {}
        self.grammars = GrammarCompiler(tokenizer, self.model.config.vocab_size)

    # what the core holds, for callers that look inside (metrics, tests)

    @property
    def requests(self) -> dict:
        return self.core.requests

    @property
    def blocks(self):
        return self.core.blocks

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def stats(self) -> dict:
        return self.core.stats

    # requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        checked = self.check_request(prompt, params)
        self.core.add_request(request_id, checked)
        self.processors[request_id] = self.output_processor(request_id, checked)

    def output_processor(self, request_id: str, checked: CheckedRequest) -> OutputProcessor:
        return OutputProcessor(request_id, checked.prompt_token_ids, checked.params, self.tokenizer)

    def check_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> CheckedRequest:
        """Tokenize and bound a request; ValueError saying what is wrong. It changes nothing, so
        it may run on another thread while the engine steps."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty")
        if max(token_ids) >= self.model.config.vocab_size or min(token_ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {self.model.config.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) leaves no room to generate within the model's context "
                f"length ({self.max_model_len} tokens)")
        default_max = self.config.max_gen_tokens or max(1, self.max_model_len // 5)
        max_tokens = params.max_tokens or min(default_max, self.max_model_len - len(token_ids))
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the model's context "
                f"length ({self.max_model_len} tokens)")
        capacity = self.config.num_blocks * self.config.block_size
        if len(token_ids) + max_tokens > capacity:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the KV cache "
                f"({capacity} tokens); give the cache more memory")
        grammar = None if params.structured_output is None else self.grammars.compile(params.structured_output)
        return CheckedRequest(token_ids, params, max_tokens, grammar)

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any point; its blocks are freed at once."""
        self.core.abort_request(request_id)
        self.processors.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PooledOutput]:
        """Each request's output from one step: text for a generation, vectors for an embeddings request
        the step finished (`core.add_pooling`)."""
        results = []
        for output in self.core.step():
            if isinstance(output, PooledOutput):
                results.append(output)
                continue
            processor = self.processors[output.request_id]
            result, stopped = processor.process(output)
            for index in stopped:
                self.core.finish_sample(output.request_id, index)
            if result.finished:
                del self.processors[output.request_id]
            results.append(result)
        return results
