"""Runs a model on its backend, one scheduled step at a time: block moves, the step's inputs (each
sampled row's from `sampling_inputs`), the backend's step executor, and the sampled tokens (and
scored prompt tokens) back on the host in one transfer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.executor import PromptScoring, StepInputs, StepResult, TokenFeed
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.models.base import DecoderModel
from candelabra.core.requests.sequence import Sequence
from candelabra.core.requests.tokens import SampledToken, ScoredToken
from candelabra.core.scheduling.output import SchedulerOutput
from candelabra.core.worker.kv_cache_size import model_kv_cache
from candelabra.core.worker.sampling_inputs import sampling_metadata


@dataclass(frozen=True)
class StepOrder:
    """All a step needs, on the host: the block moves to make first, then the inputs to run (None for
    a step that only moves blocks). Tensor-parallel ranks receive it from rank 0 and run the same."""

    swap_out: tuple[tuple[int, int], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    inputs: StepInputs | None = None


@dataclass
class LaunchedStep:
    """A step given to the device, its outputs on their way to the host (`ModelRunner.finish` waits for them)."""

    plan: SchedulerOutput
    inputs: StepInputs | None = None
    result: StepResult | None = None
    fetched: Callable[[], tuple] | None = None  # the result's tensors on the host, once copied
    scored_counts: tuple[int, ...] = ()  # prompt tokens scored per scheduled sequence, in order


@dataclass
class RunnerOutput:
    """What one step gave back, on the host: the token drawn for each of the plan's sampled sequences,
    in order, and the prompt tokens scored, by index into the plan's scheduled sequences."""

    sampled: list[SampledToken] = field(default_factory=list)
    scored: dict[int, list[ScoredToken]] = field(default_factory=dict)


class ModelRunner:
    """Owns one model's per-layer KV caches and the host swap space for them."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int,
                 kv_cache_dtype: DType | None = None) -> None:
        """`kv_cache_dtype`: the caches' dtype (default: the model's compute dtype)."""
        self.model, self.backend = model, model.backend
        self.kv_spec = model_kv_cache(model, num_blocks, block_size, kv_cache_dtype or model.dtype)
        self.caches = self.backend.allocate_kv_cache(self.kv_spec)
        self.swap_space, self.num_host_blocks = None, 0
        self.executor = self.backend.step_executor(model)
        self._executor_takes_feed = "feed" in inspect.signature(self.executor.run).parameters

    def warm_up(self, max_num_seqs: int) -> None:
        """Let the executor capture or compile its steps, for batches of up to `max_num_seqs`."""
        self.executor.warm_up(self.caches, max_num_seqs)

    def release_cached_memory(self) -> None:
        """Give back what the backend keeps for its steps' reuse (the engine is idle)."""
        self.backend.release_cached_memory()

    def allocate_swap_space(self, num_host_blocks: int) -> None:
        """Host memory for `num_host_blocks` blocks of every layer, where preempted sequences wait."""
        self.swap_space = self.backend.allocate_swap_space(replace(self.kv_spec, num_blocks=num_host_blocks))
        self.num_host_blocks = num_host_blocks

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step and bring what it sampled and scored to the host."""
        return self.finish(self.launch(plan))

    def launch(self, plan: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Give one scheduled step to the device and start copying its outputs back, without waiting for
        them. Its sequences' pending tokens (PENDING_TOKEN) were sampled by `previous`, which the device
        ran first: they reach the step on the device."""
        order = self.order(plan)
        feed = None if order.inputs is None else _token_feed(plan, order.inputs, previous)
        scored_counts = () if order.inputs is None or order.inputs.scoring is None else tuple(
            len(_positions_to_score(item.seq, item.seq.num_computed_tokens, item.num_tokens))
            for item in plan.scheduled)
        result = self.run(order, feed)
        if result is None:
            return LaunchedStep(plan, order.inputs)
        fetched = self.backend.start_fetch(*(tensor for part in result if part is not None for tensor in part))
        return LaunchedStep(plan, order.inputs, result, fetched, scored_counts)

    def finish(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's outputs and hand them back to its sequences."""
        if launched.result is None:
            return RunnerOutput()
        host = iter(launched.fetched())

        def on_host(part):  # a part's tensors as fetched, in order
            return None if part is None else [next(host) for _ in part]

        sampled, scored = on_host(launched.result.sampled), on_host(launched.result.scored)
        return RunnerOutput(_sampled_tokens(launched.plan, sampled),
                            _scored_tokens(launched.plan, launched.inputs, launched.scored_counts, scored))

    def order(self, plan: SchedulerOutput) -> StepOrder:
        """What running `plan` takes, on the host."""
        return StepOrder(_pairs(plan.swap_out), _pairs(plan.block_copies), _pairs(plan.swap_in),
                         self._inputs(plan) if plan.scheduled else None)

    def run(self, order: StepOrder, feed: TokenFeed | None = None) -> StepResult | None:
        """Make the order's block moves and run its step (its `feed` tokens taken from the previous step's
        samples on the device): its outputs (backend tensors, as the executor returns them), or None when
        the step neither samples nor scores anything."""
        self._move_blocks(order)
        if order.inputs is None:
            return None
        if feed is None:
            result, self.caches = self.executor.run(order.inputs, self.caches)
        elif not self._executor_takes_feed:  # written before steps were scheduled ahead: tokens on the host
            inputs = replace(order.inputs, token_ids=feed.filled_on_host(self.backend, order.inputs.token_ids))
            result, self.caches = self.executor.run(inputs, self.caches)
        else:
            result, self.caches = self.executor.run(order.inputs, self.caches, feed)
        if result.sampled is None and result.scored is None:
            self.backend.evaluate(self.caches)
            return None
        self.backend.evaluate(*(part for part in result if part is not None), self.caches)
        return result

    def logits(self, token_ids: np.ndarray, meta: StepMetadata):
        """The logits [N, vocab] of `meta.logits_rows` as a backend tensor, the step's keys and
        values written on the way: the model alone, without sampling (for model conformance)."""
        if meta.block_size != self.kv_spec.block_size:
            raise ValueError(f"step uses blocks of {meta.block_size}, the cache has {self.kv_spec.block_size}")
        backend = self.backend
        step = backend.prepare_step(self.model.with_rope_positions(meta))
        hidden, self.caches = self.model.forward(backend.to_device(np.asarray(token_ids, np.int32)), step,
                                                 self.caches)
        logits = self.model.compute_logits(hidden, step.logits_rows)
        backend.evaluate(logits, self.caches)
        return logits

    def _move_blocks(self, order: StepOrder) -> None:
        backend = self.backend
        if order.swap_out:
            self.swap_space = _swap("swap_out", backend.swap_out, self.caches, self.swap_space, order.swap_out)
        if order.block_copies:
            self.caches = backend.copy_blocks(self.caches, np.array(order.block_copies))
        if order.swap_in:
            self.caches = _swap("swap_in", backend.swap_in, self.caches, self.swap_space, order.swap_in)

    def _inputs(self, plan: SchedulerOutput) -> StepInputs:
        token_ids, query_lens, seq_lens, last_token = [], [], [], []
        scored_rows, scored_targets = [], []
        for item in plan.scheduled:
            seq, start, count = item.seq, item.seq.num_computed_tokens, item.num_tokens
            if seq.needs_prompt_scoring:
                for position in _positions_to_score(seq, start, count):
                    scored_rows.append(len(token_ids) + position - start)
                    scored_targets.append(seq.token_ids[position + 1])
            token_ids += seq.token_ids[start:start + count]
            query_lens.append(count)
            seq_lens.append(start + count)
            last_token.append(len(token_ids) - 1)
        rows = [last_token[item_index] for item_index, _ in plan.sampled]
        meta = StepMetadata.build(query_lens, seq_lens, plan.block_tables, self.kv_spec.block_size,
                                  logits_rows=rows)
        scoring = None
        if scored_rows:
            num_top = max(item.seq.params.prompt_logprobs or 0 for item in plan.scheduled)
            scoring = PromptScoring(np.array(scored_rows, np.int32), np.array(scored_targets, np.int32), num_top)
        return StepInputs(np.array(token_ids, dtype=np.int32), self.model.with_rope_positions(meta),
                          sampling_metadata([seq for _, seq in plan.sampled]), scoring)


def _positions_to_score(seq: Sequence, start: int, num_tokens: int) -> range:
    """The prompt positions of this chunk whose logits score the next prompt token and are not
    scored yet: each position p < len(prompt) - 1 is scored once, against prompt[p + 1]."""
    if not seq.needs_prompt_scoring:
        return range(0)
    first = seq.num_scored_prompt_tokens
    if start > first:
        raise RuntimeError(f"{seq}: prompt position {first} is to be scored but the step starts at {start}")
    return range(first, min(start + num_tokens, seq.num_prompt_tokens - 1))


def _sampled_tokens(plan: SchedulerOutput, host) -> list[SampledToken]:
    if host is None:
        return []
    token_ids, logprobs, top_ids, top_logprobs = host
    tokens = []
    for row, ((_, seq), token_id, logprob) in enumerate(zip(plan.sampled, token_ids.tolist(), logprobs.tolist())):
        k = seq.params.logprobs
        top = list(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist())) if k else []
        tokens.append(SampledToken(token_id, logprob, top))
    return tokens


def _token_feed(plan: SchedulerOutput, inputs: StepInputs, previous: LaunchedStep | None) -> TokenFeed | None:
    """Where the step's pending tokens are among its tokens, and which of `previous`'s sampled rows each is."""
    positions, rows, start = [], [], 0
    row_of = None
    for item in plan.scheduled:
        seq = item.seq
        if seq.num_pending_tokens:
            # The step before this one is the only one in flight: its token is the one pending, the last.
            if seq.num_pending_tokens > 1 or previous is None or previous.result is None:
                raise RuntimeError(f"{seq} has {seq.num_pending_tokens} pending tokens, which only the step "
                                   "launched before this one may have sampled: one")
            if row_of is None:
                row_of = {s.seq_id: row for row, (_, s) in enumerate(previous.plan.sampled)}
            offset = seq.num_tokens - 1 - seq.num_computed_tokens
            if not 0 <= offset < item.num_tokens:
                raise RuntimeError(f"{seq}: its pending token is not among the step's {item.num_tokens} for it")
            positions.append(start + offset)
            rows.append(row_of[seq.seq_id])
        start += item.num_tokens
    if not positions:
        return None
    return TokenFeed(previous.result.sampled.token_ids, np.array(positions, np.int32), np.array(rows, np.int32))


def _scored_tokens(plan: SchedulerOutput, inputs: StepInputs, counts: tuple[int, ...],
                   host) -> dict[int, list[ScoredToken]]:
    """The scored rows, which `_inputs` laid out item after item (`counts` of them each), handed back to
    their items."""
    if host is None:
        return {}
    logprobs, ranks, top_ids, top_logprobs = host
    targets, row = inputs.scoring.targets, 0
    scored = {}
    for item_index, (item, count) in enumerate(zip(plan.scheduled, counts)):
        seq = item.seq
        if not count:
            continue
        k = seq.params.prompt_logprobs
        scored[item_index] = [
            ScoredToken(int(targets[r]), float(logprobs[r]), int(ranks[r]),
                        list(zip(top_ids[r, :k].tolist(), top_logprobs[r, :k].tolist())))
            for r in range(row, row + count)]
        row += count
    return scored


def _pairs(pairs) -> tuple[tuple[int, int], ...]:
    return tuple((int(source), int(destination)) for source, destination in pairs)


def _swap(direction: str, swap, caches, space, mapping):
    try:
        return swap(caches, space, np.array(mapping))
    except Exception as exc:
        raise RuntimeError(f"{direction} of {len(mapping)} KV blocks failed: {exc}") from exc
