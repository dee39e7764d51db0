"""Runs a model on its backend, one scheduled step at a time: block moves, the step's inputs, the
backend's step executor, and the sampled tokens (and scored prompt tokens) back on the host in one
transfer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.executor import PromptScoring, StepInputs, StepResult
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata, pad_token_lists
from candelabra.core.models.base import DecoderModel
from candelabra.core.requests.sequence import Sequence
from candelabra.core.requests.tokens import SampledToken, ScoredToken
from candelabra.core.scheduling.output import SchedulerOutput


@dataclass(frozen=True)
class StepOrder:
    """All a step needs, on the host: the block moves to make first, then the inputs to run (None for
    a step that only moves blocks). Tensor-parallel ranks receive it from rank 0 and run the same."""

    swap_out: tuple[tuple[int, int], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    inputs: StepInputs | None = None


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
        c = model.config
        self.model, self.backend = model, model.backend
        self.kv_spec = KVCacheSpec(c.num_layers, num_blocks, block_size, model.num_local_kv_heads, c.head_dim,
                                   kv_cache_dtype or model.dtype)
        self.caches = self.backend.allocate_kv_cache(self.kv_spec)
        self.swap_space, self.num_host_blocks = None, 0
        self.executor = self.backend.step_executor(model)

    def warm_up(self, max_num_seqs: int) -> None:
        """Let the executor capture or compile its steps, for batches of up to `max_num_seqs`."""
        self.executor.warm_up(self.caches, max_num_seqs)

    def allocate_swap_space(self, num_host_blocks: int) -> None:
        """Host memory for `num_host_blocks` blocks of every layer, where preempted sequences wait."""
        self.swap_space = self.backend.allocate_swap_space(replace(self.kv_spec, num_blocks=num_host_blocks))
        self.num_host_blocks = num_host_blocks

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step and bring what it sampled and scored to the host."""
        order = self.order(plan)
        result = self.run(order)
        if result is None:
            return RunnerOutput()
        host = iter(self.backend.fetch(*(tensor for part in result if part is not None for tensor in part)))

        def on_host(part):  # a part's tensors as fetched, in order
            return None if part is None else [next(host) for _ in part]

        sampled, scored = on_host(result.sampled), on_host(result.scored)
        return RunnerOutput(_sampled_tokens(plan, sampled), _scored_tokens(plan, order.inputs, scored))

    def order(self, plan: SchedulerOutput) -> StepOrder:
        """What running `plan` takes, on the host."""
        return StepOrder(_pairs(plan.swap_out), _pairs(plan.block_copies), _pairs(plan.swap_in),
                         self._inputs(plan) if plan.scheduled else None)

    def run(self, order: StepOrder) -> StepResult | None:
        """Make the order's block moves and run its step: its outputs (backend tensors, as the
        executor returns them), or None when the step neither samples nor scores anything."""
        self._move_blocks(order)
        if order.inputs is None:
            return None
        result, self.caches = self.executor.run(order.inputs, self.caches)
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
        token_ids, query_lens, seq_lens, tables, last_token = [], [], [], [], []
        scored_rows, scored_targets = [], []
        for item in plan.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for position in _positions_to_score(seq, start, item.num_tokens):
                scored_rows.append(len(token_ids) + position - start)
                scored_targets.append(seq.prompt_token_ids[position + 1])
            token_ids += seq.token_ids[start:start + item.num_tokens]
            query_lens.append(item.num_tokens)
            seq_lens.append(start + item.num_tokens)
            tables.append(plan.block_tables[len(tables)])
            last_token.append(len(token_ids) - 1)
        rows = [last_token[item_index] for item_index, _ in plan.sampled]
        meta = StepMetadata.build(query_lens, seq_lens, tables, self.kv_spec.block_size, logits_rows=rows)
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
    return range(first, min(start + num_tokens, len(seq.prompt_token_ids) - 1))


def _sampled_tokens(plan: SchedulerOutput, host) -> list[SampledToken]:
    if host is None:
        return []
    token_ids, logprobs, top_ids, top_logprobs = host
    tokens = []
    for row, (_, seq) in enumerate(plan.sampled):
        k = seq.params.logprobs or 0
        top = list(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist()))
        tokens.append(SampledToken(int(token_ids[row]), float(logprobs[row]), top))
    return tokens


def _scored_tokens(plan: SchedulerOutput, inputs: StepInputs, host) -> dict[int, list[ScoredToken]]:
    """The scored rows, which `_inputs` laid out item after item, handed back to their items."""
    if host is None:
        return {}
    logprobs, ranks, top_ids, top_logprobs = host
    targets, row = inputs.scoring.targets, 0
    scored = {}
    for item_index, item in enumerate(plan.scheduled):
        seq = item.seq
        count = len(_positions_to_score(seq, seq.num_computed_tokens, item.num_tokens))
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


def sampling_metadata(seqs: list[Sequence]) -> SamplingMetadata:
    """The sampling rows of `seqs`. Token lists for the penalties are sent only for rows whose
    penalties are on, so a step without penalties does not grow with the sequences' lengths."""
    bias_ids, bias_values = [], []
    for seq in seqs:
        p = seq.params
        bias = dict(p.logit_bias)
        # Nothing may end the sequence yet, unless a structured output, which decides its own end.
        if len(seq.output_token_ids) < p.min_tokens and seq.grammar is None:
            for token in seq.end_token_ids:
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
        output_tokens=pad_token_lists([s.output_token_ids if _counts_outputs(s.params) else [] for s in seqs]),
        bias_token_ids=pad_token_lists(bias_ids),
        bias_values=values,
        uniform=np.array([s.rng.random(dtype=np.float32) for s in seqs], np.float32),
        num_top_logprobs=max((p.logprobs or 0 for p in params), default=0),
        allowed_token_mask=_allowed_token_mask(seqs),
    )


def _allowed_token_mask(seqs: list[Sequence]) -> np.ndarray | None:
    """The rows' allowed tokens from their structured outputs; None when no row has one. A row
    that may not end yet (min_tokens not reached, or its end of text ignored) loses its end tokens
    while its grammar allows anything else."""
    constrained = [(row, seq) for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not constrained:
        return None
    mask = np.full((len(seqs), constrained[0][1].grammar.mask_words), -1, dtype=np.int32)
    for row, seq in constrained:
        seq.grammar.allowed_token_mask(mask[row])
        if seq.params.ignore_eos or len(seq.output_token_ids) < seq.params.min_tokens:
            _forbid_unless_alone(mask[row], seq.grammar.end_token_ids | seq.end_token_ids)
    return mask


def _forbid_unless_alone(row: np.ndarray, token_ids) -> None:
    bits = row.view(np.uint32)
    kept = bits.copy()
    for token in token_ids:
        if token < 32 * len(kept):
            kept[token >> 5] &= ~np.uint32(1 << (token & 31))
    if kept.any():
        bits[:] = kept


def _repetition_window(seq: Sequence) -> list[int]:
    """The tokens the repetition penalty looks at: none when it is off, else all of them or the
    last repeat_last_n."""
    last_n = seq.params.repeat_last_n
    if seq.params.repetition_penalty == 1 or last_n == 0:
        return []
    return seq.token_ids if last_n is None else seq.token_ids[-last_n:]


def _counts_outputs(params) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0
