"""On the CPU, the torch backend's top-k and top-p draws look for their candidates among each row's
most probable tokens before sorting the row: they must choose what the sorted draw chooses, with
the same logprobs, whatever the filters and however the logits tie."""

import dataclasses

import numpy as np
import pytest
import torch

from candelabra.backends.torch import sampling
from candelabra.backends.torch.sampling import TorchSampling, sample
from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists


def _metadata(rng, rows, **fields) -> SamplingMetadata:
    """Sampling parameters for `rows` rows: the given ones, no filters, penalties or bias otherwise."""
    defaults = dict(temperature=np.ones(rows), top_k=np.zeros(rows), top_p=np.ones(rows), min_p=np.zeros(rows),
                    repetition_penalty=np.ones(rows), presence_penalty=np.zeros(rows),
                    frequency_penalty=np.zeros(rows))
    defaults.update(fields)
    empty = pad_token_lists([[]] * rows)
    return SamplingMetadata(
        **{name: np.asarray(value).astype(np.int32 if name == "top_k" else np.float32)
           for name, value in defaults.items()},
        penalty_tokens=empty, output_tokens=empty, bias_token_ids=empty, bias_values=np.zeros(empty.shape, np.float32),
        uniform=rng.random(rows, dtype=np.float32), num_top_logprobs=3)


def _random_filters(rng, rows, vocab) -> dict:
    """Per row, any mix of greedy, temperature, top-k (1 and past the vocabulary too), top-p (at its
    extremes too) and min-p, rows without a filter among them."""
    return dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.0, 1.7], rows),
                top_k=rng.choice([0, 0, 1, 2, 40, 300, vocab, vocab + 7], rows),
                top_p=rng.choice([1.0, 1.0, 0.0001, 0.3, 0.9, 0.99999], rows),
                min_p=rng.choice([0.0, 0.0, 0.0, 0.1], rows))


def _logits(rng, rows, vocab, scale, dtype=torch.float32, tied=False) -> torch.Tensor:
    logits = rng.standard_normal((rows, vocab)) * scale
    if tied:
        logits = np.round(logits * 2) / 2  # a coarse grid: many equal logits, as in low precision
    return torch.from_numpy(logits.astype(np.float32)).to(dtype)


class _Preselections:
    """Counts the rows that the preselection was asked for and those it left to a sort, and records
    how many of each row's tokens every search for survivors looked at."""

    def __init__(self, monkeypatch):
        self.asked = self.left = 0
        self.widths: list[int] = []
        preselect, threshold = sampling._draw_preselected, sampling._survivor_threshold

        def counted(d, pending, chosen):
            left = preselect(d, pending, chosen)
            self.asked += pending.shape[0]
            self.left += left.shape[0]
            return left

        def recorded(d, descending):
            self.widths.append(descending.shape[1])
            return threshold(d, descending)

        monkeypatch.setattr(sampling, "_draw_preselected", counted)
        monkeypatch.setattr(sampling, "_survivor_threshold", recorded)

    @property
    def held(self) -> int:
        return self.asked - self.left


def _assert_same_as_sorted(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    params = TorchSampling.prepare(meta, logits.device)
    preselected = sample(logits, params)
    sorted_ = sample(logits, dataclasses.replace(params, on_cpu=False))  # every rank filter by a sort
    assert torch.equal(preselected.token_ids, sorted_.token_ids), (preselected.token_ids, sorted_.token_ids)
    assert torch.equal(preselected.logprobs, sorted_.logprobs)
    assert torch.equal(preselected.top_token_ids, sorted_.top_token_ids)
    assert torch.equal(preselected.top_logprobs, sorted_.top_logprobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_preselected_draws_choose_the_tokens_and_logprobs_of_sorted_draws(monkeypatch, dtype):
    preselections = _Preselections(monkeypatch)
    for seed in range(40):
        rng = np.random.default_rng([31, seed])
        rows, vocab = int(rng.integers(1, 12)), int(rng.choice([4096, 20000]))
        logits = _logits(rng, rows, vocab, scale=rng.choice([1.0, 3.0, 8.0]), dtype=dtype, tied=seed % 3 == 0)
        _assert_same_as_sorted(logits, _metadata(rng, rows, **_random_filters(rng, rows, vocab)))
    assert preselections.held > 100 and preselections.left > 0  # both ways were taken


def test_a_qwen_sized_vocabulary_draws_as_the_sort_does(monkeypatch):
    preselections = _Preselections(monkeypatch)
    rng = np.random.default_rng(32)
    rows, vocab = 12, 151936
    logits = _logits(rng, rows, vocab, scale=3.0)
    _assert_same_as_sorted(logits, _metadata(rng, rows, **_random_filters(rng, rows, vocab)))
    assert preselections.held > 0


@pytest.mark.parametrize("top_p", [0.0001, 0.5, 0.99999])
def test_top_p_at_its_extremes_draws_as_the_sort_does(top_p):
    for seed in range(6):
        rng = np.random.default_rng([33, seed])
        rows, vocab = 8, 8192
        logits = _logits(rng, rows, vocab, scale=[0.5, 3.0, 12.0][seed % 3], tied=seed % 2 == 1)
        _assert_same_as_sorted(logits, _metadata(rng, rows, temperature=rng.choice([0.7, 1.0], rows),
                                                 top_p=np.full(rows, top_p)))


@pytest.mark.parametrize("top_k", [1, 2, 255, 256, 257, 8192, 8193, 100000])
def test_top_k_from_one_to_past_the_vocabulary_draws_as_the_sort_does(top_k):
    for seed in range(6):
        rng = np.random.default_rng([34, seed, top_k])
        rows, vocab = 8, 8192
        logits = _logits(rng, rows, vocab, scale=3.0, tied=seed % 2 == 1)
        _assert_same_as_sorted(logits, _metadata(rng, rows, top_k=np.full(rows, top_k),
                                                 top_p=rng.choice([1.0, 0.8], rows)))


def test_a_tie_across_the_preselection_keeps_every_tied_token(monkeypatch):
    """More tokens tie at the k-th weight than the preselection holds: all stay candidates, so the
    draw must widen, and a draw near 1 lands on the last of them."""
    preselections = _Preselections(monkeypatch)
    rng = np.random.default_rng(35)
    rows, vocab, tied = 4, 65536, 3 * sampling.PRESELECT
    logits = _logits(rng, rows, vocab, scale=1.0)
    tied_ids = np.sort(rng.choice(vocab, tied, replace=False))
    logits[:, tied_ids] = 10.0
    meta = _metadata(rng, rows, top_k=np.full(rows, 40), top_p=np.array([1.0, 0.9, 1.0, 0.9]))
    meta.uniform[:] = [0.9999, 0.9999, 0.0, 0.5]
    _assert_same_as_sorted(logits, meta)
    preselections.widths.clear()
    chosen = sample(logits, TorchSampling.prepare(meta, logits.device)).token_ids.numpy()
    assert chosen[0] == tied_ids[-1] and chosen[2] == tied_ids[0]
    assert preselections.widths[0] == sampling.PRESELECT and tied < preselections.widths[1] < vocab  # it widened


def test_rows_whose_survivors_outgrow_each_preselection_are_widened_then_sorted(monkeypatch):
    monkeypatch.setattr(sampling, "PRESELECT", 4)
    preselections = _Preselections(monkeypatch)
    for seed in range(10):
        rng = np.random.default_rng([36, seed])
        rows, vocab = 10, 4096
        # flat rows keep many survivors, peaked ones a few
        scales = torch.from_numpy(np.geomspace(0.05, 30, rows, dtype=np.float32))[:, None]
        logits = _logits(rng, rows, vocab, scale=1.0) * scales
        _assert_same_as_sorted(logits, _metadata(rng, rows, top_p=rng.choice([0.5, 0.9, 0.99], rows),
                                                 min_p=rng.choice([0.0, 0.01], rows)))
    assert preselections.held > 0 and preselections.left > 0


def test_a_top_k_or_top_p_batch_of_peaked_rows_sorts_no_row(monkeypatch):
    """What the preselection is for: over 151,936 tokens a sort takes thirty times as long as a top 256."""
    def refuse(*args, **kwargs):
        raise AssertionError("sorted a row")

    rng = np.random.default_rng(37)
    rows, vocab = 6, 151936
    logits = _logits(rng, rows, vocab, scale=4.0)
    meta = _metadata(rng, rows, temperature=np.full(rows, 0.7), top_k=[40, 40, 0, 0, 1, 0],
                     top_p=[1.0, 0.9, 0.9, 0.95, 1.0, 1.0])
    monkeypatch.setattr(torch, "sort", refuse)
    result = sample(logits, TorchSampling.prepare(meta, logits.device))
    assert result.token_ids.shape == (rows,)
    assert result.token_ids[4] == torch.argmax(logits[4])  # top_k 1


def test_top_p_counts_every_top_k_token_into_its_total_when_k_passes_the_preselection():
    """A thousand nearly equal tokens, top_k 1000 and top_p 0.2: the survivors are the first 200
    or so of them, not a fifth of the first PRESELECT, which a total over those alone would give."""
    rng = np.random.default_rng(38)
    rows, vocab, flat = 2, 8192, 1000
    logits = torch.full((rows, vocab), -30.0)
    logits[:, :flat] = -1e-4 * torch.arange(flat)  # in decreasing order of weight
    meta = _metadata(rng, rows, top_k=np.full(rows, flat), top_p=np.full(rows, 0.2))
    meta.uniform[:] = 0.9999
    _assert_same_as_sorted(logits, meta)
    chosen = sample(logits, TorchSampling.prepare(meta, logits.device)).token_ids.numpy()
    assert np.all((180 < chosen) & (chosen < 200)), chosen
