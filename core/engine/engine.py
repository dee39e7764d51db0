"""The engine: requests in, one scheduled batch per `step()`, tokens and text out.

Each step the scheduler picks the batch, the engine moves KV blocks as the block manager says
(copy-on-write copies, swaps to and from host memory), runs the model on the batch, samples a
token for every sequence that reached its end, and applies each request's stopping rules. A
request with n > 1 forks into n sequences at its first sampled token, sharing the prompt's blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata, pad_token_lists
from candelabra.core.engine.detokenizer import IncrementalDetokenizer
from candelabra.core.engine.sampling_params import SamplingParams
from candelabra.core.engine.sequence import Sequence
from candelabra.core.engine.stop_strings import StopStringMatcher
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.scheduler import ScheduledSequence, Scheduler
from candelabra.core.worker.model_runner import ModelRunner


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 512
    num_host_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512  # 0: a prompt is prefilled in one step
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_gen_tokens: int | None = None  # default max_tokens; None: a fifth of the context
    preemption: str = "auto"
    seed: int | None = None  # for requests that name none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed `LLMEngine.check_request`, ready to be added."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int


class _Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 seed: int) -> None:
        self.request_id, self.prompt_token_ids, self.params = request_id, prompt_token_ids, params
        self.max_tokens, self.seed = max_tokens, seed
        self.sequences: list[Sequence] = []
        self.texts: dict[int, str] = {}
        self.decoders: dict[int, tuple[IncrementalDetokenizer, StopStringMatcher]] = {}
        self.reported: dict[int, tuple[int, int]] = {}  # per index: text length and tokens already returned

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)


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
        if config.block_size != runner.kv_spec.block_size or config.num_blocks != runner.kv_spec.num_blocks:
            raise ValueError("the engine's block size and count must be the model runner's")
        if not config.prefill_chunk_size and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must hold a "
                f"whole prompt of up to max_model_len ({self.max_model_len}) tokens")
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.num_host_blocks,
                                   config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_size, config.preemption)
        self.swap_space = None
        if config.num_host_blocks:
            host_spec = KVCacheSpec(runner.kv_spec.num_layers, config.num_host_blocks, config.block_size,
                                    runner.kv_spec.num_kv_heads, runner.kv_spec.head_dim, runner.kv_spec.dtype)
            self.swap_space = self.backend.allocate_swap_space(host_spec)
        self.requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "cached_prompt_tokens": 0, "steps": 0}

    # requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        self.add_checked_request(request_id, self.check_request(prompt, params))

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
        return CheckedRequest(token_ids, params, max_tokens)

    def add_checked_request(self, request_id: str, checked: CheckedRequest) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        token_ids, params = checked.prompt_token_ids, checked.params
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        request = _Request(request_id, token_ids, params, checked.max_tokens, seed)
        seq = Sequence(request_id, 0, token_ids, params, next(self._arrivals), _sequence_rng(seed, 0))
        self._attach(request, seq)
        self.requests[request_id] = request
        self.stats["prompt_tokens"] += len(token_ids)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any point; its blocks are freed at once."""
        if request_id in self.requests:
            self.scheduler.abort(request_id)
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # stepping

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self._move_blocks(plan)
        if not plan.scheduled:
            if self.scheduler.has_unfinished() and not plan.preempted and not plan.swap_in:
                raise RuntimeError("no request can be scheduled: the KV cache cannot hold the waiting prompt")
            return []
        self.stats["steps"] += 1
        logits = self.runner.execute(*self._batch(plan.scheduled))
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.mark_computed(item.seq.seq_id, item.seq.num_computed_tokens)
        sampling_rows = [(row, item.seq) for row, item in enumerate(plan.scheduled) if _samples(item)]
        outputs = [self._output(self.requests[request_id]) for request_id in self._sample(logits, sampling_rows)]
        for output in outputs:
            if output.finished:
                self.stats["cached_prompt_tokens"] += output.num_cached_tokens
                del self.requests[output.request_id]
        return outputs

    def _move_blocks(self, plan) -> None:
        backend, runner = self.backend, self.runner
        if plan.swap_out:
            self.swap_space = backend.swap_out(runner.caches, self.swap_space, np.array(plan.swap_out))
        if plan.block_copies:
            runner.caches = backend.copy_blocks(runner.caches, np.array(plan.block_copies))
        if plan.swap_in:
            runner.caches = backend.swap_in(runner.caches, self.swap_space, np.array(plan.swap_in))

    def _batch(self, scheduled: list[ScheduledSequence]) -> tuple[np.ndarray, StepMetadata]:
        token_ids, query_lens, seq_lens, tables = [], [], [], []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            token_ids += seq.token_ids[start:start + item.num_tokens]
            query_lens.append(item.num_tokens)
            seq_lens.append(start + item.num_tokens)
            tables.append(self.blocks.block_table(seq.seq_id))
        meta = StepMetadata.build(query_lens, seq_lens, tables, self.config.block_size)
        return np.array(token_ids, dtype=np.int32), meta

    def _sample(self, logits, rows: list[tuple[int, Sequence]]) -> list[str]:
        """Sample one token for each (logits row, sequence); forks n > 1 requests first."""
        rows = [(row, forked) for row, seq in rows for forked in self._fork_if_first(seq)]
        if not rows:
            return []
        backend, ops = self.backend, self.backend.ops
        picked = logits
        if [row for row, _ in rows] != list(range(logits.shape[0])):
            picked = ops.gather_rows(logits, backend.to_device(np.array([r for r, _ in rows], dtype=np.int32)))
        seqs = [seq for _, seq in rows]
        result = ops.sample(picked, backend.prepare_sampling(self._sampling_metadata(seqs)))
        backend.evaluate(result)
        tokens = backend.to_host(result.token_ids)
        logprobs, top_ids, top_logprobs = (backend.to_host(x) for x in result[1:])
        touched = []
        for i, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                seq.logprobs.append({"token_id": int(tokens[i]), "logprob": float(logprobs[i]),
                                     "top": list(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))})
            self._accept(seq, int(tokens[i]))
            touched.append(seq.request_id)
        return list(dict.fromkeys(touched))

    def _fork_if_first(self, seq: Sequence) -> list[Sequence]:
        request = self.requests[seq.request_id]
        if seq.output_token_ids or len(request.sequences) == request.params.n:
            return [seq]
        children = []
        for index in range(1, request.params.n):
            child = seq.fork(index, _sequence_rng(request.seed, index))
            self.blocks.fork(seq.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            self._attach(request, child)
            children.append(child)
        return [seq, *children]

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        eos = self.tokenizer.eos_token_ids | set(self.model.config.eos_token_ids)
        bias_ids, bias_values = [], []
        for seq in seqs:
            p = seq.params
            bias = dict(p.logit_bias)
            if len(seq.output_token_ids) < p.min_tokens:  # nothing may end the sequence yet
                for token in (set() if p.ignore_eos else eos) | set(p.stop_token_ids):
                    bias[token] = float("-inf")
            bias_ids.append(list(bias))
            bias_values.append(list(bias.values()))
        params = [s.params for s in seqs]
        width = pad_token_lists(bias_ids).shape[1]
        values = np.zeros((len(seqs), width), dtype=np.float32)
        for row, row_values in enumerate(bias_values):
            values[row, : len(row_values)] = row_values
        return SamplingMetadata(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32),
            presence_penalty=np.array([p.presence_penalty for p in params], np.float32),
            frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32),
            penalty_tokens=pad_token_lists([_repetition_window(s) for s in seqs]),
            output_tokens=pad_token_lists([s.output_token_ids for s in seqs]),
            bias_token_ids=pad_token_lists(bias_ids),
            bias_values=values,
            uniform=np.array([s.rng.random(dtype=np.float32) for s in seqs], np.float32),
            num_top_logprobs=max((p.logprobs or 0) for p in params),
        )

    def _accept(self, seq: Sequence, token: int) -> None:
        """Record a sampled token and apply the request's stopping rules."""
        request, p = self.requests[seq.request_id], seq.params
        seq.output_token_ids.append(token)
        self.stats["generated_tokens"] += 1
        detokenizer, stops = request.decoders[seq.index]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            # The ending token itself is not part of the text.
            request.texts[seq.index] += stops.feed(detokenizer.flush())[0] + stops.finish()
            return self.scheduler.finish(seq, "stop")
        emitted, stopped = stops.feed(detokenizer.add(token))
        request.texts[seq.index] += emitted
        if stopped:
            return self.scheduler.finish(seq, "stop")
        if len(seq.output_token_ids) >= request.max_tokens or seq.num_tokens >= self.max_model_len:
            request.texts[seq.index] += stops.feed(detokenizer.flush())[0] + stops.finish()
            self.scheduler.finish(seq, "length")

    def _attach(self, request: _Request, seq: Sequence) -> None:
        request.sequences.append(seq)
        request.texts[seq.index] = ""
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                             skip_special_tokens=request.params.skip_special_tokens)
        request.decoders[seq.index] = (detokenizer, StopStringMatcher(request.params.stop))

    def _output(self, request: _Request) -> RequestOutput:
        outputs = []
        for seq in sorted(request.sequences, key=lambda s: s.index):
            text = request.texts[seq.index]
            text_done, tokens_done = request.reported.get(seq.index, (0, 0))
            request.reported[seq.index] = (len(text), len(seq.output_token_ids))
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                delta_text=text[text_done:], delta_token_ids=seq.output_token_ids[tokens_done:]))
        cached = max((s.num_cached_prompt_tokens for s in request.sequences), default=0)
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, request.finished, cached)


def _samples(item: ScheduledSequence) -> bool:
    """Whether the step just run reached the end of the sequence, so it gets a new token."""
    return item.seq.num_computed_tokens == item.seq.num_tokens


def _sequence_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def _repetition_window(seq: Sequence) -> list[int]:
    """The tokens the repetition penalty looks at: all of them, or the last repeat_last_n."""
    last_n = seq.params.repeat_last_n
    if last_n is None:
        return seq.token_ids
    return seq.token_ids[-last_n:] if last_n else []
