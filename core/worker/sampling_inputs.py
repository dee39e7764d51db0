"""What each sampled row of a step asks of the sampler, from its sequence: temperature and filters,
penalties with the tokens they look at, logit bias (with min_tokens' ban on ending early folded in),
the structured output's allowed tokens, and the row's uniform draw (none for a greedy row, which
needs none and whose generator nothing else reads)."""

from __future__ import annotations

import numpy as np

from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists
from candelabra.core.requests.sequence import Sequence


def sampling_metadata(seqs: list[Sequence]) -> SamplingMetadata:
    """The sampling rows of `seqs`. Token lists for the penalties are sent only for rows whose
    penalties are on, so a step without penalties does not grow with the sequences' lengths."""
    bias_ids, bias_values = [], []
    for seq in seqs:
        p = seq.params
        # Nothing may end the sequence yet, unless a structured output, which decides its own end.
        banned = seq.num_output_tokens < p.min_tokens and seq.grammar is None
        if not p.logit_bias and not banned:
            bias_ids.append(())
            bias_values.append(())
            continue
        bias = dict(p.logit_bias)
        if banned:
            for token in seq.end_token_ids:
                bias[token] = float("-inf")
        bias_ids.append(list(bias))
        bias_values.append(list(bias.values()))
    params = [s.params for s in seqs]
    bias_token_ids = pad_token_lists(bias_ids)
    values = np.zeros(bias_token_ids.shape, dtype=np.float32)
    for row, row_values in enumerate(bias_values):
        if row_values:
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
        bias_token_ids=bias_token_ids,
        bias_values=values,
        uniform=np.array([s.rng.random(dtype=np.float32) if s.params.temperature else 0.0 for s in seqs], np.float32),
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
        if seq.params.ignore_eos or seq.num_output_tokens < seq.params.min_tokens:
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


def reads_its_tokens(seq: Sequence) -> bool:
    """Whether the sequence's sampling row is built from its tokens so far: its penalties count them, or
    its structured output's mask follows them."""
    return seq.grammar is not None or _penalises_repetition(seq.params) or _counts_outputs(seq.params)


def _repetition_window(seq: Sequence) -> list[int]:
    """The tokens the repetition penalty looks at: none when it is off, else all of them or the
    last repeat_last_n."""
    if not _penalises_repetition(seq.params):
        return []
    last_n = seq.params.repeat_last_n
    return seq.token_ids if last_n is None else seq.token_ids[-last_n:]


def _penalises_repetition(params) -> bool:
    return params.repetition_penalty != 1 and params.repeat_last_n != 0


def _counts_outputs(params) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0
