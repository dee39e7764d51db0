"""Sampling draws from the right distribution: frequencies over many draws match the probabilities."""

import numpy as np

from candelabra.backends.cpu import CpuBackend
from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists


def _params(rows, rng, temperature=1.0, top_k=0, top_p=1.0):
    return SamplingMetadata(
        temperature=np.full(rows, temperature, np.float32), top_k=np.full(rows, top_k, np.int32),
        top_p=np.full(rows, top_p, np.float32), min_p=np.zeros(rows, np.float32),
        repetition_penalty=np.ones(rows, np.float32), presence_penalty=np.zeros(rows, np.float32),
        frequency_penalty=np.zeros(rows, np.float32), penalty_tokens=pad_token_lists([[]] * rows),
        output_tokens=pad_token_lists([[]] * rows), bias_token_ids=pad_token_lists([[]] * rows),
        bias_values=np.zeros((rows, 1), np.float32), uniform=rng.random(rows, dtype=np.float32),
    )


def test_draws_follow_the_tempered_distribution():
    rng = np.random.default_rng(21)
    draws, logits = 40000, rng.standard_normal(6).astype(np.float32)
    result = CpuBackend().ops.sample(np.tile(logits, (draws, 1)), _params(draws, rng, temperature=0.7))
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    observed = np.bincount(result.token_ids, minlength=6) / draws
    # four standard errors of a binomial proportion
    assert np.all(np.abs(observed - expected) <= 4 * np.sqrt(expected * (1 - expected) / draws) + 1e-4)


def test_top_p_keeps_the_smallest_nucleus():
    rng = np.random.default_rng(22)
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    draws = 20000
    result = CpuBackend().ops.sample(np.tile(logits, (draws, 1)), _params(draws, rng, top_p=0.7))
    observed = np.bincount(result.token_ids, minlength=4) / draws
    # 0.5 alone is below 0.7, 0.5 + 0.3 reaches it: the nucleus is the first two tokens
    assert observed[2] == observed[3] == 0
    assert abs(observed[0] - 0.5 / 0.8) < 0.02
