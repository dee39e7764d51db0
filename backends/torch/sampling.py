"""Token sampling in PyTorch, vectorised over the rows of a batch (see `Ops.sample`).

What the batch needs is known on the host when the step is prepared (any bias, penalty, random
row or rank filter), so a greedy batch without penalties is an argmax and one log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from candelabra.core.contract.ops import SampleResult
from candelabra.core.contract.step_metadata import SamplingMetadata


@dataclass
class TorchSampling:
    """A SamplingMetadata's arrays as torch tensors, with what the host knows about the batch."""

    host: SamplingMetadata
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
    allowed_token_mask: torch.Tensor | None
    has_bias: bool
    has_repetition_penalty: bool
    has_count_penalties: bool
    random_rows: torch.Tensor | None  # the rows that draw at random; None when all are greedy
    all_random: bool
    needs_sort: bool
    has_min_p: bool
    unit_temperature: bool  # every random row at temperature 1: its weights are exp(x - max) as they are

    @classmethod
    def prepare(cls, meta: SamplingMetadata, device: torch.device) -> TorchSampling:
        def put(array, dtype):
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype)

        random_rows = np.flatnonzero(meta.temperature > 0)
        return cls(
            host=meta,            temperature=put(meta.temperature, torch.float32),
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
            allowed_token_mask=None if meta.allowed_token_mask is None else put(meta.allowed_token_mask, torch.int32),
            has_bias=bool(np.any(meta.bias_token_ids >= 0)),
            has_repetition_penalty=bool(np.any(meta.penalty_tokens >= 0) and np.any(meta.repetition_penalty != 1)),
            has_count_penalties=bool(np.any(meta.output_tokens >= 0)
                                     and np.any((meta.presence_penalty != 0) | (meta.frequency_penalty != 0))),
            random_rows=put(random_rows, torch.int64) if random_rows.size else None,
            all_random=random_rows.size == meta.num_rows,
            needs_sort=bool(np.any(meta.top_k[random_rows] > 0) or np.any(meta.top_p[random_rows] < 1)),
            has_min_p=bool(np.any(meta.min_p[random_rows] > 0)),
            unit_temperature=bool(np.all(meta.temperature[random_rows] == 1)),
        )


# Rows are sampled this many at a time, so that each [rows, vocabulary] float32 temporary stays below
# glibc's largest mmap threshold (32 MiB) and reuses freed heap memory instead of faulting in fresh
# pages: 64 rows of a 151,936-token vocabulary at once took 130 ms, in chunks of 16 rows 30 ms.
ROWS_PER_CHUNK = 16
# Inverse-CDF draws sum the vocabulary in blocks of this many first, then only within the block the
# draw lands in: two short passes instead of a cumulative sum as long as the vocabulary.
DRAW_BLOCK = 1024


def sample(logits: torch.Tensor, params: TorchSampling) -> SampleResult:
    rows = logits.shape[0]
    if rows <= ROWS_PER_CHUNK:
        return _sample(logits, params)
    device = logits.device
    parts = [_sample(logits[start:start + ROWS_PER_CHUNK], TorchSampling.prepare(_rows(params.host, start), device))
             for start in range(0, rows, ROWS_PER_CHUNK)]
    return SampleResult(*(torch.cat(field) for field in zip(*parts)))


def _rows(meta: SamplingMetadata, start: int) -> SamplingMetadata:
    """Rows start .. start + ROWS_PER_CHUNK of `meta`."""
    return replace(meta, **{f.name: getattr(meta, f.name)[start:start + ROWS_PER_CHUNK] for f in fields(meta)
                            if isinstance(getattr(meta, f.name), np.ndarray)})


def _sample(logits: torch.Tensor, params: TorchSampling) -> SampleResult:
    x = _penalised_logits(logits, params)
    # log-probabilities as logits minus their log-sum-exp: only the chosen and top ones are needed
    rows = params.random_rows
    if rows is None:
        normaliser = torch.logsumexp(x, dim=1, keepdim=True)
        chosen = torch.argmax(x, dim=1)
    else:
        # exp(x - max) gives the log-sum-exp and, at temperature 1, the draw's weights: one pass for both
        shifted = x - x.amax(dim=1, keepdim=True)
        exps = torch.exp(shifted)
        normaliser = x.amax(dim=1, keepdim=True) + torch.log(exps.sum(dim=1, keepdim=True))
        if params.all_random:
            chosen = _draw(shifted, exps, params, rows)
        else:
            drawn = _draw(shifted.index_select(0, rows), exps.index_select(0, rows), params, rows)
            chosen = torch.argmax(x, dim=1).index_copy(0, rows, drawn)
    top_ids, top_logprobs = _top_logprobs(x, normaliser, params.num_top_logprobs)
    return SampleResult(
        token_ids=chosen.to(torch.int32),
        logprobs=(x.gather(1, chosen[:, None]) - normaliser)[:, 0],
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
    if p.allowed_token_mask is not None:
        x = x.masked_fill(~allowed_tokens(p.allowed_token_mask, vocab), float("-inf"))
    return x


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] booleans from an allowed-token bitmask (see SamplingMetadata)."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].bool()


def _padding_to(tokens: torch.Tensor, column: int) -> torch.Tensor:
    return torch.where(tokens >= 0, tokens, column)


def _token_counts(tokens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows, vocab = shape
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, _padding_to(tokens, vocab), torch.ones(tokens.shape, dtype=torch.float32,
                                                                   device=tokens.device))
    return counts[:, :vocab]


def _draw(shifted: torch.Tensor, exps: torch.Tensor, p: TorchSampling, rows: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws in increasing id order over each row's surviving candidates. `shifted` is
    the rows' logits less their largest, `exps` their exponentials; the weights need not sum to one."""
    if p.unit_temperature:
        probs = exps
    else:
        probs = torch.exp(shifted / p.temperature.index_select(0, rows)[:, None])
    keep = None
    if p.needs_sort:
        keep = _top_k_top_p(probs, p.top_k.index_select(0, rows), p.top_p.index_select(0, rows))
    if p.has_min_p:
        above = probs >= p.min_p.index_select(0, rows)[:, None] * probs.max(dim=1, keepdim=True).values
        keep = above if keep is None else keep & above
    weights = probs if keep is None else probs.masked_fill(~keep, 0)
    chosen = _inverse_cdf(weights, p.uniform.index_select(0, rows))
    if keep is None:
        return torch.clamp(chosen, max=probs.shape[1] - 1)
    ids = torch.arange(probs.shape[1], device=probs.device)
    last_candidate = torch.where(keep, ids, -1).max(dim=1).values
    return torch.minimum(chosen, last_candidate)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first id whose cumulative weight (summed in float64, in id order) exceeds
    uniform times the row's total; at least the vocabulary's size when rounding leaves none."""
    weights = weights.contiguous()
    rows, vocab = weights.shape
    whole = vocab // DRAW_BLOCK
    # the whole blocks as a view of each row, and the rest of the row as one more block
    block_sums = weights.as_strided((rows, whole, DRAW_BLOCK), (weights.stride(0), DRAW_BLOCK, 1)).sum(
        dim=2, dtype=torch.float64)
    if vocab > whole * DRAW_BLOCK:
        rest = weights[:, whole * DRAW_BLOCK:].sum(dim=1, keepdim=True, dtype=torch.float64)
        block_sums = torch.cat([block_sums, rest], dim=1)
    blocks = block_sums.shape[1]
    before_block = torch.cumsum(block_sums, dim=1)
    targets = uniform * before_block[:, -1]
    block = torch.clamp((before_block <= targets[:, None]).sum(dim=1), max=blocks - 1)
    offset = torch.where(block > 0, before_block.gather(1, torch.clamp(block - 1, min=0)[:, None])[:, 0], 0)
    ids = block[:, None] * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    in_block = weights.gather(1, torch.clamp(ids, max=vocab - 1)).masked_fill(ids >= vocab, 0)
    within = torch.cumsum(in_block.double(), dim=1) + offset[:, None]
    return block * DRAW_BLOCK + (within <= targets[:, None]).sum(dim=1)


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


def _top_logprobs(x: torch.Tensor, normaliser: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    if count == 0:
        return (torch.zeros(rows, 0, dtype=torch.int32, device=x.device),
                torch.zeros(rows, 0, dtype=torch.float32, device=x.device))
    values, ids = torch.topk(x, min(count, x.shape[1]), dim=1)
    return ids.to(torch.int32), values - normaliser
