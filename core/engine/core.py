"""The engine's core: requests as token ids in, sampled tokens out, one scheduled step at a time.

A step is three calls: the scheduler picks the batch, the model runner runs it and draws the
tokens, the scheduler updates itself from them. Then the oldest embeddings request in progress runs
its next slice in the tokens the scheduler kept for it (core/engine/pooling.py).

Text (detokenizing, stop strings) is not the core's business: an `OutputProcessor` turns the core's
outputs into text wherever the caller likes, and finishes a sample here when one of its stop
strings appears.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from candelabra.core.engine.pooling import PooledOutput, PoolingJob
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.sequence import Sequence, sample_rng
from candelabra.core.requests.structured_output import Grammar
from candelabra.core.requests.tokens import SampledToken, ScoredToken
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.scheduler import Scheduler
from candelabra.core.worker.model_runner import LaunchedStep, ModelRunner
from candelabra.core.worker.sampling_inputs import reads_its_tokens


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 512
    num_host_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512  # 0: a prompt is prefilled in one step
    enable_prefix_caching: bool = True
    reuse_written_blocks_first: bool = False  # see BlockManager; the backend's kv_cache_committed_on_write
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_gen_tokens: int | None = None  # default max_tokens; None: a fifth of the context
    preemption: str = "auto"
    seed: int | None = None  # for requests that name none
    # Schedule and launch each step before the step in flight has returned its tokens, so that the host's work
    # for a step overlaps the device's for the one before (see EngineCore.step). None: where the backend runs
    # apart from the host and the runner can take a step's tokens from the step before on the device.
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed `LLMEngine.check_request`, ready to be added."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: Grammar | None = None  # the compiled structured output


@dataclass
class SampleUpdate:
    """One sample's new token in a step. `finish_reason` is "stop" (an end token, which is not
    part of the text, or a completed structured output) or "length" when this token ended it,
    else None."""

    index: int
    token_id: int
    logprob: SampledToken | None  # when asked for
    finish_reason: str | None
    end_token: bool = False  # the token is one of the sample's end tokens


@dataclass
class EngineOutput:
    """What one step did for one request."""

    request_id: str
    updates: list[SampleUpdate] = field(default_factory=list)
    finished: bool = False  # no sample of it is left in the core
    num_cached_tokens: int = 0
    # With its first tokens, when asked for: each prompt token after the first as the model scored it.
    prompt_logprobs: list[ScoredToken] | None = None


class _Request:
    def __init__(self, request_id: str, checked: CheckedRequest, seed: int) -> None:
        self.request_id, self.params, self.seed = request_id, checked.params, seed
        self.prompt_token_ids = checked.prompt_token_ids
        self.sequences: list[Sequence] = []

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)


class EngineCore:
    def __init__(self, runner: ModelRunner, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        if config.async_scheduling is None:
            config = replace(config, async_scheduling=runner.backend.runs_apart_from_host())
        self.runner, self.config, self.eos_token_ids = runner, config, eos_token_ids
        if config.block_size != runner.kv_spec.block_size or config.num_blocks != runner.kv_spec.num_blocks:
            raise ValueError("the engine's block size and count must be the model runner's")
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.num_host_blocks,
                                   config.enable_prefix_caching, config.reuse_written_blocks_first)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_size, config.preemption)
        self.requests: dict[str, _Request] = {}
        self.pooling: dict[str, PoolingJob] = {}  # embeddings requests in progress, oldest first
        self._reserved = 0  # tokens the step just scheduled left for the next pooling slice
        self._arrivals = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "cached_prompt_tokens": 0, "steps": 0,
                      "pooled_tokens": 0}
        self._in_flight: LaunchedStep | None = None
        runner.warm_up(config.max_num_seqs)

    def add_request(self, request_id: str, checked: CheckedRequest) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        params = checked.params
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        request = _Request(request_id, checked, seed)
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(request_id, 0, checked.prompt_token_ids, params, next(self._arrivals), sample_rng(seed, 0),
                       seed=seed, max_tokens=checked.max_tokens, end_token_ids=ends)
        if checked.grammar is not None:
            seq.grammar = checked.grammar.matcher()
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.stats["prompt_tokens"] += len(checked.prompt_token_ids)
        self.scheduler.add(seq)

    def add_pooling(self, request_id: str, job: PoolingJob) -> None:
        """Queue an embeddings request; its PooledOutput comes from the step that runs its last slice."""
        if request_id in self.requests or request_id in self.pooling:
            raise ValueError(f"request {request_id!r} already exists")
        capacity = self.config.num_blocks * self.config.block_size
        longest = max(len(tokens) for tokens in job.inputs)
        if longest > capacity:
            raise ValueError(f"an input of {longest} tokens is more than the KV cache holds ({capacity} tokens)")
        self.pooling[request_id] = job

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any point; its blocks are freed at once."""
        if request_id in self.requests:
            self.scheduler.abort(request_id)
            del self.requests[request_id]
        job = self.pooling.pop(request_id, None)
        if job is not None:
            job.release()

    def finish_sample(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one sample of a request (a stop string appeared in its text); its blocks are freed."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.index == index and not seq.is_finished:
                self.scheduler.finish(seq, reason)
        if request.finished:
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self.pooling)

    def step(self) -> list[EngineOutput | PooledOutput]:
        """One step's outputs, and the pooled output of an embeddings request that the step's pooling
        slice finished. With async scheduling, the outputs are those of the step launched by the call
        before, and this call launches the next step before waiting for them."""
        outputs = self._step_ahead() if self.config.async_scheduling else self._step_in_turn()
        return outputs + self._pool()

    def _schedule(self):
        plan = self.scheduler.schedule(self._pooling_demand())
        self._reserved = plan.reserved
        return plan

    def _pooling_demand(self) -> int:
        """Tokens the oldest embeddings request would run next: as many as a prompt's chunk at most."""
        if not self.pooling:
            return 0
        job = next(iter(self.pooling.values()))
        return min(job.remaining_tokens, self.config.prefill_chunk_size or self.config.max_num_batched_tokens)

    def _pool(self) -> list[PooledOutput]:
        """The oldest embeddings request's next slice, in the tokens the step left for it; its output
        when that was its last."""
        if not self.pooling or not self._reserved:
            return []
        request_id, job = next(iter(self.pooling.items()))
        config = self.config
        ran = job.advance(self.runner, self.blocks, self._reserved, config.max_num_seqs,
                          config.prefill_chunk_size or config.max_num_batched_tokens)
        self._reserved = 0
        self.stats["pooled_tokens"] += ran
        if not job.done:
            return []
        del self.pooling[request_id]
        job.release()
        return [PooledOutput(request_id, job.result(), job.num_tokens)]

    def _step_in_turn(self) -> list[EngineOutput]:
        plan = self._schedule()
        output = self.runner.execute(plan)  # block moves happen even when nothing runs
        if not plan.scheduled:
            self._check_progress(plan)
            return []
        self.stats["steps"] += 1
        for child in plan.forked:
            self.requests[child.request_id].sequences.append(child)
        return self._outputs(self.scheduler.update_from_output(plan, output.sampled, output.scored))

    def _step_ahead(self) -> list[EngineOutput]:
        """Schedule and launch the next step while the one in flight runs, its samples pending tokens that
        reach the next step on the device; then wait for the one in flight and take its tokens. A sequence
        that one of them ends has computed one token for nothing. Where the next step's inputs need the
        tokens on the host (penalties count them, a structured output's next mask follows them, prompt
        scoring continues after them), the step in flight is finished first."""
        previous, self._in_flight, outputs = self._in_flight, None, []
        if previous is not None and _next_step_needs_its_tokens(previous):
            outputs, previous = self._resolved(previous), None
        plan = self._schedule()
        launched = self.runner.launch(plan, previous)
        if plan.scheduled:
            self.scheduler.commit(plan)
            self.stats["steps"] += 1
            for child in plan.forked:
                self.requests[child.request_id].sequences.append(child)
            self._in_flight = launched
        elif previous is None and not outputs:  # nothing ran, nothing came back
            self._check_progress(plan)
        if previous is not None:
            outputs = self._resolved(previous)
        return outputs

    def _check_progress(self, plan) -> None:
        """A plan that runs nothing while requests wait, and moves no blocks to make room, never will; unless
        an embeddings request runs, whose blocks come back as its inputs finish."""
        if self.scheduler.has_unfinished() and not plan.preempted and not plan.swap_in and not self.pooling:
            raise RuntimeError("no request can be scheduled: the KV cache cannot hold the waiting prompt")

    def _resolved(self, launched: LaunchedStep) -> list[EngineOutput]:
        output = self.runner.finish(launched)
        return self._outputs(self.scheduler.resolve(launched.plan, output.sampled, output.scored))

    def _outputs(self, accepted) -> list[EngineOutput]:
        outputs: dict[str, EngineOutput] = {}
        for seq, token in accepted:
            output = outputs.get(seq.request_id)
            if output is None:
                output = outputs[seq.request_id] = EngineOutput(seq.request_id)
            logprob = token if seq.params.logprobs is not None else None
            output.updates.append(SampleUpdate(seq.index, token.token_id, logprob, seq.finish_reason,
                                               token.token_id in seq.end_token_ids))
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1:
                output.prompt_logprobs = list(seq.prompt_logprobs)
        self.stats["generated_tokens"] += len(accepted)
        for output in outputs.values():
            request = self.requests[output.request_id]
            output.num_cached_tokens = max(s.num_cached_prompt_tokens for s in request.sequences)
            if request.finished:
                output.finished = True
                self.stats["cached_prompt_tokens"] += output.num_cached_tokens
                del self.requests[output.request_id]
        return list(outputs.values())


def _next_step_needs_its_tokens(launched: LaunchedStep) -> bool:
    """Whether a step launched after `launched` needs its tokens on the host: to score the prompt on from
    where it stopped, or to build a sampling row from a sequence's tokens."""
    if launched.inputs is not None and launched.inputs.scoring is not None:
        return True
    return any(reads_its_tokens(seq) for _, seq in launched.plan.sampled)
