"""Token sampling in PyTorch, vectorised over the rows of a batch (see `Ops.sample`).

What the batch needs is known on the host when the step is prepared (any bias, penalty, random
row or rank filter), so a greedy batch without penalties is an argmax and one log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from candelabra.core.contract.ops import SampleResult
from candelabra.core.contract.step_metadata import SamplingMetadata


@dataclass
class TorchSampling:
    """A SamplingMetadata's arrays as torch tensors, with what the host knows about the batch."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    penalty_tokens: torch.Tensor
    output_tokens: torch.Tensor
    bias_token_ids: torch.Tensor
    bias_values: torch.Tensor
    uniform: torch.Tensor
    num_top_logprobs: int
    has_bias: bool
    has_repetition_penalty: bool
    has_count_penalties: bool
    random_rows: torch.Tensor | None  # the rows that draw at random; None when all are greedy
    needs_sort: bool

    @classmethod
    def prepare(cls, meta: SamplingMetadata, device: torch.device) -> TorchSampling:
        def put(array, dtype):
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype)

        random_rows = np.flatnonzero(meta.temperature > 0)
        return cls(
            temperature=put(meta.temperature, torch.float32),
            top_k=put(meta.top_k, torch.int64),
            top_p=put(meta.top_p, torch.float64),
            min_p=put(meta.min_p, torch.float32),
            repetition_penalty=put(meta.repetition_penalty, torch.float32),
            presence_penalty=put(meta.presence_penalty, torch.float32),
            frequency_penalty=put(meta.frequency_penalty, torch.float32),
            penalty_tokens=put(meta.penalty_tokens, torch.int64),
            output_tokens=put(meta.output_tokens, torch.int64),
            bias_token_ids=put(meta.bias_token_ids, torch.int64),
            bias_values=put(meta.bias_values, torch.float32),
            uniform=put(meta.uniform, torch.float64),
            num_top_logprobs=meta.num_top_logprobs,
            has_bias=bool(np.any(meta.bias_token_ids >= 0)),
            has_repetition_penalty=bool(np.any(meta.penalty_tokens >= 0) and np.any(meta.repetition_penalty != 1)),
            has_count_penalties=bool(np.any(meta.output_tokens >= 0)
                                     and np.any((meta.presence_penalty != 0) | (meta.frequency_penalty != 0))),
            random_rows=put(random_rows, torch.int64) if random_rows.size else None,
            needs_sort=bool(np.any(meta.top_k[random_rows] > 0) or np.any(meta.top_p[random_rows] < 1)),
        )


def sample(logits: torch.Tensor, params: TorchSampling) -> SampleResult:
    x = _penalised_logits(logits, params)
    logprobs = torch.log_softmax(x, dim=1)
    chosen = torch.argmax(x, dim=1)
    if params.random_rows is not None:
        rows = params.random_rows
        chosen = chosen.index_copy(0, rows, _draw(x.index_select(0, rows), params, rows))
    top_ids, top_logprobs = _top_logprobs(logprobs, params.num_top_logprobs)
    return SampleResult(
        token_ids=chosen.to(torch.int32),
        logprobs=logprobs.gather(1, chosen[:, None])[:, 0],
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def _penalised_logits(logits: torch.Tensor, p: TorchSampling) -> torch.Tensor:
    x = logits.float()
    vocab = x.shape[1]
    if p.has_bias:
        # Padding (NO_TOKEN) lands in an extra column past the vocabulary, dropped afterwards.
        widened = torch.nn.functional.pad(x, (0, 1))
        widened.scatter_add_(1, _padding_to(p.bias_token_ids, vocab), p.bias_values)
        x = widened[:, :vocab]
    if p.has_repetition_penalty:
        penalised = _token_counts(p.penalty_tokens, x.shape) > 0
        r = p.repetition_penalty[:, None]
        x = torch.where(penalised, torch.where(x > 0, x / r, x * r), x)
    if p.has_count_penalties:
        counts = _token_counts(p.output_tokens, x.shape)
        x = x - (p.frequency_penalty[:, None] * counts + p.presence_penalty[:, None] * (counts > 0))
    return x


def _padding_to(tokens: torch.Tensor, column: int) -> torch.Tensor:
    return torch.where(tokens >= 0, tokens, column)


def _token_counts(tokens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows, vocab = shape
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, _padding_to(tokens, vocab), torch.ones(tokens.shape, dtype=torch.float32,
                                                                   device=tokens.device))
    return counts[:, :vocab]


def _draw(x: torch.Tensor, p: TorchSampling, rows: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws in increasing id order over each row's surviving candidates."""
    probs = torch.softmax(x / p.temperature.index_select(0, rows)[:, None], dim=1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.needs_sort:
        keep = _top_k_top_p(probs, p.top_k.index_select(0, rows), p.top_p.index_select(0, rows))
    min_p = p.min_p.index_select(0, rows)[:, None]
    keep &= probs >= min_p * probs.max(dim=1, keepdim=True).values
    cumulative = torch.cumsum(torch.where(keep, probs, 0).double(), dim=1)
    targets = p.uniform.index_select(0, rows) * cumulative[:, -1]
    chosen = (cumulative <= targets[:, None]).sum(dim=1)
    last_candidate = probs.shape[1] - 1 - torch.argmax(keep.flip(1).to(torch.uint8), dim=1)
    return torch.minimum(chosen, last_candidate)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Candidates after top-k, then top-p among those, as value thresholds on sorted rows. A row
    with neither filter keeps everything: k = vocabulary, p = 1."""
    descending = torch.sort(probs, dim=1, descending=True).values
    vocab = probs.shape[1]
    k = torch.where(top_k > 0, torch.clamp(top_k, max=vocab), vocab)
    kth_value = descending.gather(1, (k - 1)[:, None])
    # Everything tied with the k-th value stays a candidate and counts towards top-p's total.
    descending = torch.where(descending >= kth_value, descending, 0).double()
    mass_above = torch.cumsum(descending, dim=1) - descending
    survivors = (mass_above < top_p[:, None] * descending.sum(dim=1, keepdim=True)) & (descending > 0)
    survivors[:, 0] = True
    last_survivor = survivors.sum(dim=1) - 1  # mass_above only grows, so survivors are a prefix
    threshold = descending.gather(1, last_survivor[:, None])
    return probs >= threshold.to(probs.dtype)


def _top_logprobs(logprobs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logprobs.shape[0]
    if count == 0:
        return (torch.zeros(rows, 0, dtype=torch.int32, device=logprobs.device),
                torch.zeros(rows, 0, dtype=torch.float32, device=logprobs.device))
    values, ids = torch.topk(logprobs, min(count, logprobs.shape[1]), dim=1)
    return ids.to(torch.int32), values
