"""Token sampling in numpy, vectorised over the rows of a batch (see `Ops.sample`)."""

from __future__ import annotations

import numpy as np

from candelabra.core.contract.ops import SampleResult
from candelabra.core.contract.step_metadata import SamplingMetadata


def sample(logits: np.ndarray, params: SamplingMetadata) -> SampleResult:
    x = _penalised_logits(logits, params)
    logprobs = _log_softmax(x)
    rows = np.arange(x.shape[0])
    greedy = params.temperature == 0
    chosen = np.argmax(x, axis=1)
    if not greedy.all():
        random_rows = np.flatnonzero(~greedy)
        chosen[random_rows] = _draw(x[random_rows], params, random_rows)
    top_ids, top_logprobs = _top_logprobs(logprobs, params.num_top_logprobs)
    return SampleResult(
        token_ids=chosen.astype(np.int32),
        logprobs=logprobs[rows, chosen],
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def _penalised_logits(logits: np.ndarray, p: SamplingMetadata) -> np.ndarray:
    x = logits.astype(np.float32, copy=True)
    rows = np.arange(x.shape[0])[:, None]

    has_bias = p.bias_token_ids >= 0
    if has_bias.any():
        bias_rows = np.broadcast_to(rows, has_bias.shape)[has_bias]
        np.add.at(x, (bias_rows, p.bias_token_ids[has_bias]), p.bias_values[has_bias])

    penalised = _token_mask(p.penalty_tokens, x.shape)
    r = p.repetition_penalty[:, None].astype(np.float32)
    x = np.where(penalised, np.where(x > 0, x / r, x * r), x)

    counts = _token_counts(p.output_tokens, x.shape)
    x -= p.frequency_penalty[:, None] * counts + p.presence_penalty[:, None] * (counts > 0)
    if p.allowed_token_mask is not None:
        x = np.where(allowed_tokens(p.allowed_token_mask, x.shape[1]), x, np.float32(-np.inf))
    return x


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """[B, vocab] booleans from an allowed-token bitmask (see SamplingMetadata)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def _token_mask(tokens: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    rows, cols = np.nonzero(tokens >= 0)
    mask[rows, tokens[rows, cols]] = True
    return mask


def _token_counts(tokens: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    counts = np.zeros(shape, dtype=np.float32)
    rows, cols = np.nonzero(tokens >= 0)
    np.add.at(counts, (rows, tokens[rows, cols]), 1)
    return counts


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _draw(x: np.ndarray, p: SamplingMetadata, rows: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws in increasing id order over each row's surviving candidates."""
    probs = np.exp(_log_softmax(x / p.temperature[rows, None]))
    keep = np.ones(probs.shape, dtype=bool)

    top_k = p.top_k[rows]
    top_p = p.top_p[rows].astype(np.float64)
    needs_sort = (top_k > 0) | (top_p < 1)
    if needs_sort.any():
        sorted_rows = np.flatnonzero(needs_sort)
        keep[sorted_rows] = _top_k_top_p(probs[sorted_rows], top_k[sorted_rows], top_p[sorted_rows])

    min_p = p.min_p[rows, None]
    keep &= probs >= min_p * probs.max(axis=1, keepdims=True)

    cumulative = np.cumsum(np.where(keep, probs, 0).astype(np.float64), axis=1)
    targets = p.uniform[rows].astype(np.float64) * cumulative[:, -1]
    chosen = (cumulative <= targets[:, None]).sum(axis=1)
    last_candidate = probs.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=1)
    return np.minimum(chosen, last_candidate)


def _top_k_top_p(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Candidates after top-k, then top-p among those, as value thresholds on sorted rows."""
    descending = -np.sort(-probs, axis=1)
    vocab = probs.shape[1]
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    kth_value = descending[np.arange(len(k)), k - 1][:, None]
    # Everything tied with the k-th value stays a candidate and counts towards top-p's total.
    descending = np.where(descending >= kth_value, descending, 0).astype(np.float64)
    # Within the top-k candidates, a token survives top-p while the mass above it is < top_p.
    mass_above = np.cumsum(descending, axis=1) - descending
    survivors = (mass_above < top_p[:, None] * descending.sum(axis=1, keepdims=True)) & (descending > 0)
    survivors[:, 0] = True
    last_survivor = survivors.sum(axis=1) - 1  # mass_above only grows, so survivors are a prefix
    # Ties with the last survivor stay too.
    threshold = descending[np.arange(len(k)), last_survivor]
    return probs >= threshold[:, None].astype(probs.dtype)


def _top_logprobs(logprobs: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    rows = logprobs.shape[0]
    if count == 0:
        return np.zeros((rows, 0), dtype=np.int32), np.zeros((rows, 0), dtype=np.float32)
    count = min(count, logprobs.shape[1])
    candidates = np.argpartition(-logprobs, count - 1, axis=1)[:, :count]
    order = np.argsort(-np.take_along_axis(logprobs, candidates, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(candidates, order, axis=1)
    return ids.astype(np.int32), np.take_along_axis(logprobs, ids, axis=1).astype(np.float32)
