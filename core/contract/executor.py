"""Step execution: the hook through which a backend may run a whole step itself.

The model runner hands each step to the executor that `Backend.step_executor(model)` returns: the
step's host inputs in, the sampled tokens (and the scored prompt tokens) out as backend tensors
(fetched to the host by the runner in one transfer). The default executor runs the model graph op
by op. A backend that captures steps (CUDA graphs) or compiles them (MLX) returns its own executor,
which may pad each batch to sizes of its choosing with `pad_step_inputs` and keep persistent
buffers of those sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from candelabra.core.contract.ops import KVCache, SampleResult, TokenLogprobs
from candelabra.core.contract.step_metadata import NO_SLOT, NO_TOKEN, SamplingMetadata, StepMetadata


@dataclass(frozen=True)
class PromptScoring:
    """Prompt tokens a step scores: the logits of the step's token `rows[m]` (int32 [M], indices
    into the step's tokens) against the prompt token `targets[m]` that follows it, with the
    `num_top` most likely alternatives (`Ops.token_logprobs`)."""

    rows: np.ndarray
    targets: np.ndarray
    num_top: int

    def __post_init__(self) -> None:
        if self.rows.shape != self.targets.shape or not len(self.rows):
            raise ValueError("prompt scoring needs as many targets as rows, and at least one")


@dataclass(frozen=True)
class StepInputs:
    """One step on the host: token_ids[T] int32, the batch layout (whose `logits_rows` pick the
    N rows to sample), the N rows' sampling parameters, and the prompt tokens to score, if any."""

    token_ids: np.ndarray
    step: StepMetadata
    sampling: SamplingMetadata
    scoring: PromptScoring | None = None

    @property
    def num_rows(self) -> int:
        return self.sampling.num_rows


@dataclass(frozen=True)
class TokenFeed:
    """Tokens of a step that the step before it sampled, not yet on the host (the engine scheduled this
    step ahead of the device): token `positions[f]` of the step is row `rows[f]` of `source`, the sampled
    token ids (backend tensor, int32 [R]) of the step before. In `StepInputs.token_ids` they are
    PENDING_TOKEN (-1)."""

    source: Any
    positions: np.ndarray  # int32 [F]
    rows: np.ndarray  # int32 [F]

    def filled_on_host(self, backend: Any, token_ids: np.ndarray) -> np.ndarray:
        """`token_ids` with the fed tokens written in, fetched from the device (which waits for them)."""
        (source,) = backend.fetch(self.source)
        filled = token_ids.copy()
        filled[self.positions] = source[self.rows]
        return filled


class StepResult(NamedTuple):
    """A step's outputs as backend tensors: the sampled rows (None when it samples none) and the
    scored prompt tokens (None when it scores none)."""

    sampled: SampleResult | None
    scored: TokenLogprobs | None = None


class StepExecutor:
    """Runs one step of `model` on `backend`, op by op: prepare the step, forward, gather the
    logits rows, sample, and score the prompt tokens asked for."""

    def __init__(self, backend: Any, model: Any) -> None:
        self.backend, self.model = backend, model

    def warm_up(self, caches: list[KVCache], max_num_seqs: int) -> None:
        """Called once before the first step with the caches every step will use and the most
        sequences one step will hold. An executor that captures or compiles steps does it here, so
        that start-up pays for it rather than the first requests; it must leave the caches as they
        are. The default does nothing."""

    def run(self, inputs: StepInputs, caches: list[KVCache],
            feed: TokenFeed | None = None) -> tuple[StepResult, list[KVCache]]:
        """The sampled tokens of `inputs.num_rows` rows and the scores of `inputs.scoring` (backend
        tensors, not yet evaluated on a lazy backend), and the updated caches; `feed` names the tokens
        to take from the previous step's sampled ones."""
        backend, ops = self.backend, self.backend.ops
        step = backend.prepare_step(inputs.step)
        hidden, caches = self.model.forward(self.token_ids(inputs, feed), step, caches)
        sampled = scored = None
        if inputs.num_rows:
            logits = self.model.compute_logits(hidden, step.logits_rows)
            sampled = ops.sample(logits, backend.prepare_sampling(inputs.sampling))
        if inputs.scoring is not None:
            scoring = inputs.scoring
            logits = self.model.compute_logits(hidden, backend.to_device(scoring.rows))
            scored = ops.token_logprobs(logits, backend.to_device(scoring.targets), scoring.num_top)
        return StepResult(sampled, scored), caches

    def token_ids(self, inputs: StepInputs, feed: TokenFeed | None):
        """The step's token ids on the device, the fed ones taken from the previous step's samples. The
        default fetches those to the host first; an executor that can index on the device does it there,
        so that the host need not wait for the previous step."""
        token_ids = inputs.token_ids if feed is None else feed.filled_on_host(self.backend, inputs.token_ids)
        return self.backend.to_device(token_ids)


def pad_step_inputs(inputs: StepInputs, num_tokens: int, num_seqs: int, num_rows: int) -> StepInputs:
    """`inputs` padded to exactly `num_tokens` tokens, `num_seqs` sequences and `num_rows` sampling
    rows, for an executor that runs fixed shapes. Each padding token is a sequence of its own, one
    token long, whose K/V go nowhere (NO_SLOT); padding rows sample that token greedily. The first
    `inputs.num_rows` rows of the result are the real ones."""
    step, sampling = inputs.step, inputs.sampling
    extra_tokens, extra_seqs = num_tokens - step.num_tokens, num_seqs - step.num_seqs
    extra_rows = num_rows - sampling.num_rows
    if extra_tokens < 0 or extra_seqs < 0 or extra_rows < 0:
        raise ValueError(f"cannot pad a step of {step.num_tokens} tokens, {step.num_seqs} sequences and "
                         f"{sampling.num_rows} rows down to {num_tokens}, {num_seqs} and {num_rows}")
    if extra_seqs != extra_tokens:
        raise ValueError("each padding token is a sequence of its own: pad tokens and sequences alike")
    if extra_rows and not extra_tokens:
        raise ValueError("padding rows need a padding token to read")
    query_lens = np.diff(step.query_start_loc).tolist() + [1] * extra_seqs
    seq_lens = step.seq_lens.tolist() + [1] * extra_seqs
    tables = [row for row in step.block_tables] + [step.block_tables[0]] * extra_seqs
    slots = np.concatenate([step.slot_mapping, np.full(extra_tokens, NO_SLOT, np.int32)])
    rows = np.concatenate([step.logits_rows, np.full(extra_rows, step.num_tokens, np.int32)])
    padded = StepMetadata.build(query_lens, seq_lens, tables, step.block_size, step.block_tables.shape[1],
                                logits_rows=rows, slot_mapping=slots)
    rope = np.concatenate([step.rope_positions, np.zeros(extra_tokens, np.int32)])
    token_ids = np.concatenate([inputs.token_ids, np.zeros(extra_tokens, np.int32)])
    return StepInputs(token_ids.astype(np.int32), padded.with_rope_positions(rope),
                      _padded_sampling(sampling, extra_rows), inputs.scoring)


def _padded_sampling(sampling: SamplingMetadata, extra: int) -> SamplingMetadata:
    """`extra` more rows that take the argmax, with no penalty, bias or top logprobs of their own."""
    if not extra:
        return sampling
    neutral = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0, "uniform": 0.0, "bias_values": 0.0,
               "penalty_tokens": NO_TOKEN, "output_tokens": NO_TOKEN, "bias_token_ids": NO_TOKEN}
    fields = {}
    for name, fill in neutral.items():
        value = getattr(sampling, name)
        tail = np.full((extra, *value.shape[1:]), fill, dtype=value.dtype)
        fields[name] = np.concatenate([value, tail])
    return replace(sampling, **fields)
