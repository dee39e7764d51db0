"""Token sampling in MLX (see `Ops.sample`), every row at once and with static shapes."""

from __future__ import annotations

import mlx.core as mx

from candelabra.core.contract.ops import SampleResult


def sample(logits, p) -> SampleResult:
    x = _penalised_logits(logits.astype(mx.float32), p)
    logprobs = x - _logsumexp(x)
    greedy = mx.argmax(x, axis=1)
    random = _draw(x, p)
    chosen = mx.where(p.temperature == 0, greedy, random).astype(mx.int32)
    top_ids, top_logprobs = _top_logprobs(logprobs, p.num_top_logprobs)
    return SampleResult(
        token_ids=chosen,
        logprobs=mx.take_along_axis(logprobs, chosen[:, None], axis=1)[:, 0],
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def _logsumexp(x, chunk: int = 1024):
    """[B, 1] log-sum-exp by chunks, then over the chunk sums: a float32 reduction over a whole
    vocabulary in one sequential pass (as on MLX's CPU) is off by up to 1e-3."""
    vocab = x.shape[1]
    if vocab <= chunk:
        return mx.logsumexp(x, axis=1, keepdims=True)
    padded = mx.pad(x, [(0, 0), (0, -vocab % chunk)], constant_values=-mx.inf)
    partial = mx.logsumexp(padded.reshape(x.shape[0], -1, chunk), axis=2)
    return mx.logsumexp(partial, axis=1, keepdims=True)


def _scatter_add(shape, token_ids, amounts):
    """[B, V] sums of `amounts` at `token_ids` per row; ids of -1 are padding and add nothing."""
    real = token_ids >= 0
    rows = mx.broadcast_to(mx.arange(shape[0])[:, None], token_ids.shape)
    return mx.zeros(shape, mx.float32).at[rows, mx.where(real, token_ids, 0)].add(mx.where(real, amounts, 0))


def _penalised_logits(x, p):
    x = x + _scatter_add(x.shape, p.bias_token_ids, p.bias_values)
    penalised = _scatter_add(x.shape, p.penalty_tokens, mx.ones(p.penalty_tokens.shape)) > 0
    r = p.repetition_penalty[:, None]
    x = mx.where(penalised, mx.where(x > 0, x / r, x * r), x)
    counts = _scatter_add(x.shape, p.output_tokens, mx.ones(p.output_tokens.shape))
    x = x - p.frequency_penalty[:, None] * counts - p.presence_penalty[:, None] * (counts > 0)
    if p.allowed_token_mask is not None:
        x = mx.where(_allowed_tokens(p.allowed_token_mask, x.shape[1]), x, -mx.inf)
    return x


def _allowed_tokens(mask, vocab: int):
    """[B, vocab] booleans from an allowed-token bitmask (see SamplingMetadata)."""
    bits = mx.right_shift(mask[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab] == 1


def _draw(x, p):
    """Inverse-CDF draws in increasing id order over each row's surviving candidates."""
    vocab = x.shape[1]
    temperature = mx.where(p.temperature > 0, p.temperature, 1)[:, None]
    probs = mx.softmax(x / temperature, axis=1, precise=True)
    keep = probs >= p.min_p[:, None] * probs.max(axis=1, keepdims=True)
    if p.needs_sort:
        keep = keep & _top_k_top_p(probs, p.top_k, p.top_p)
    cumulative = mx.cumsum(mx.where(keep, probs, 0), axis=1)
    target = p.uniform[:, None] * cumulative[:, -1:]
    chosen = (cumulative <= target).sum(axis=1)
    last_candidate = mx.where(keep, mx.arange(vocab), -1).max(axis=1)
    return mx.minimum(chosen, last_candidate)


def _top_k_top_p(probs, top_k, top_p):
    vocab = probs.shape[1]
    descending = -mx.sort(-probs, axis=1)
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab)
    kth_value = mx.take_along_axis(descending, (k - 1)[:, None], axis=1)
    # Everything tied with the k-th value stays a candidate and counts towards top-p's total.
    descending = mx.where(descending >= kth_value, descending, 0)
    mass_above = mx.cumsum(descending, axis=1) - descending
    survivors = (mass_above < top_p[:, None] * descending.sum(axis=1, keepdims=True)) & (descending > 0)
    survivors = survivors | (mx.arange(vocab)[None, :] == 0)
    last_survivor = survivors.sum(axis=1, keepdims=True) - 1  # survivors form a prefix
    return probs >= mx.take_along_axis(descending, last_survivor, axis=1)


def _top_logprobs(logprobs, count):
    rows = logprobs.shape[0]
    if count == 0:
        return mx.zeros((rows, 0), mx.int32), mx.zeros((rows, 0), mx.float32)
    count = min(count, logprobs.shape[1])
    candidates = mx.argpartition(-logprobs, kth=count - 1, axis=1)[:, :count]
    values = mx.take_along_axis(logprobs, candidates, axis=1)
    order = mx.argsort(-values, axis=1)
    return (mx.take_along_axis(candidates, order, axis=1).astype(mx.int32),
            mx.take_along_axis(values, order, axis=1))
