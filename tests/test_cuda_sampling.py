"""The cuda backend's sampling kernel against the float64 sampling oracle, on the GPU or under the
Triton interpreter on CPU tensors (float32 and float16 logits; bfloat16 is unreliable in the interpreter)."""


import contextlib

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.kernels import sampling as sampling_kernel
from candelabra.backends.cuda.kernels.sampling import ROW_BLOCK, sample
from candelabra.backends.torch.sampling import TorchSampling
from candelabra.conformance import oracle
from candelabra.conformance.compare import nmse
from candelabra.conformance.op_cases import CDF_TOLERANCE, allowed_token_mask
from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
DTYPES = {"float32": torch.float32, "float16": torch.float16}
MODES = ("greedy", "temperature", "top_k", "top_p", "min_p", "combined", "penalties", "bias", "allowed")


def _metadata(rng, rows, vocab, mode, logprobs, **overrides) -> SamplingMetadata:
    enabled = lambda name: mode in (name, "combined")  # noqa: E731
    temperature = np.zeros(rows) if mode == "greedy" else rng.uniform(0.5, 1.5, rows)
    if mode in ("combined", "penalties", "allowed"):
        temperature[: rows // 3] = 0  # greedy rows among the random ones
    penalise, biased = mode == "penalties", mode in ("penalties", "bias")

    def token_lists(longest):
        return [rng.integers(0, vocab, rng.integers(1, longest)).tolist() for _ in range(rows)]

    no_tokens = [[] for _ in range(rows)]
    bias_ids = token_lists(8) if biased else no_tokens
    bias_values = np.zeros(pad_token_lists(bias_ids).shape, np.float32)
    for row, ids in enumerate(bias_ids):
        bias_values[row, : len(ids)] = rng.uniform(-5, 5, len(ids))
    fields = dict(
        temperature=temperature,
        top_k=rng.integers(1, 50, rows) if enabled("top_k") else np.zeros(rows),
        top_p=rng.uniform(0.5, 0.95, rows) if enabled("top_p") else np.ones(rows),
        min_p=rng.uniform(0.01, 0.2, rows) if enabled("min_p") else np.zeros(rows),
        repetition_penalty=rng.uniform(1.1, 1.5, rows) if penalise else np.ones(rows),
        presence_penalty=rng.uniform(0, 1, rows) if penalise else np.zeros(rows),
        frequency_penalty=rng.uniform(0, 1, rows) if penalise else np.zeros(rows),
    )
    fields.update(overrides)
    return SamplingMetadata(
        **{name: np.asarray(value).astype(np.int32 if name == "top_k" else np.float32)
           for name, value in fields.items()},
        penalty_tokens=pad_token_lists(token_lists(40) if penalise else no_tokens),
        output_tokens=pad_token_lists(token_lists(30) if penalise else no_tokens),
        bias_token_ids=pad_token_lists(bias_ids),
        bias_values=bias_values,
        uniform=rng.random(rows, dtype=np.float32),
        num_top_logprobs=logprobs,
        allowed_token_mask=allowed_token_mask(rng, rows, vocab) if mode == "allowed" else None,
    )


def _logits(rng, rows, vocab, dtype, tied=False):
    logits = rng.standard_normal((rows, vocab)) * 3.0
    if tied:
        logits = np.round(logits * 2) / 2  # a coarse grid: many equal logits, as in low precision
    return torch.from_numpy(logits).to(DEVICE, DTYPES[dtype])


def _run_and_compare(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    result = sample(logits, TorchSampling.prepare(meta, logits.device))
    ref = oracle.sample(float64_values(logits), meta)
    rows, vocab = logits.shape
    tokens = result.token_ids.cpu().numpy().astype(np.int64)
    assert result.token_ids.dtype == torch.int32 and tokens.shape == (rows,)
    assert np.all((tokens >= 0) & (tokens < vocab)), tokens
    for row in range(rows):
        token, expected, u = tokens[row], ref["token_ids"][row], float(meta.uniform[row])
        if meta.temperature[row] == 0:
            assert token == expected, f"greedy row {row}: chose {token}, expected {expected}"
            continue
        # A different token is only acceptable when the draw sits within rounding of a boundary.
        low, high = ref["cdf_low"][row, expected], ref["cdf_high"][row, expected]
        near_boundary = u - low < CDF_TOLERANCE or high - u < CDF_TOLERANCE
        inside = (ref["candidates"][row, token]
                  and ref["cdf_low"][row, token] - CDF_TOLERANCE <= u < ref["cdf_high"][row, token] + CDF_TOLERANCE)
        assert token == expected or (near_boundary and inside), (
            f"row {row}: chose {token} for draw {u:.6f}, expected {expected}")
    assert result.logprobs.dtype == torch.float32
    assert nmse(result.logprobs.cpu().numpy(), ref["all_logprobs"][np.arange(rows), tokens]) < 1e-9
    top_ids = result.top_token_ids.cpu().numpy().astype(np.int64)
    assert result.top_token_ids.dtype == torch.int32 and top_ids.shape == ref["top_token_ids"].shape
    assert result.top_logprobs.dtype == torch.float32
    if top_ids.size:
        assert nmse(result.top_logprobs.cpu().numpy(), ref["top_logprobs"]) < 1e-9
        assert all(len(set(ids)) == len(ids) for ids in top_ids.tolist())
        # equal logprobs may come in any order: each id must carry a top value
        carried = ref["all_logprobs"][np.arange(rows)[:, None], top_ids]
        assert nmse(carried, ref["top_logprobs"]) < 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_small_vocabulary_every_mode(dtype, mode):
    rng = np.random.default_rng([1, MODES.index(mode), list(DTYPES).index(dtype)])
    for logprobs in (0, 5):
        _run_and_compare(_logits(rng, 8, 1000, dtype), _metadata(rng, 8, 1000, mode, logprobs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["greedy", "top_k", "top_p", "combined"])
def test_logits_with_many_ties_sample_as_the_oracle_does(dtype, mode):
    rng = np.random.default_rng([2, len(mode), list(DTYPES).index(dtype)])
    _run_and_compare(_logits(rng, 8, 1000, dtype, tied=True), _metadata(rng, 8, 1000, mode, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["combined", "penalties"])
def test_a_llama_sized_vocabulary_samples_as_the_oracle_does(dtype, mode):
    rng = np.random.default_rng([3, len(mode), list(DTYPES).index(dtype)])
    _run_and_compare(_logits(rng, 4, 32000, dtype), _metadata(rng, 4, 32000, mode, 20))


@pytest.mark.parametrize("mode", ["greedy", "combined"])
def test_a_qwen_sized_vocabulary_samples_as_the_oracle_does(mode):
    rng = np.random.default_rng([4, len(mode)])
    temperature = [0.0, 0.0] if mode == "greedy" else [0.0, 0.8]  # the interpreter is slow: one random row
    _run_and_compare(_logits(rng, 2, 151936, "float16"), _metadata(rng, 2, 151936, mode, 5, temperature=temperature))


@pytest.mark.parametrize("vocab", [1, 3, 513, 2049])
def test_vocabularies_shorter_than_or_one_past_a_block_sample_as_the_oracle_does(vocab):
    """One-element rows, rows shorter than a block, one past a search block and a row block."""
    rng = np.random.default_rng([5, vocab])
    _run_and_compare(_logits(rng, 6, vocab, "float32"), _metadata(rng, 6, vocab, "combined", min(20, vocab)))


def test_filters_and_temperatures_at_their_extremes_sample_as_the_oracle_does():
    """top_k 1 and beyond the vocabulary, a tiny top_p, min_p 1, a near-zero temperature."""
    rng = np.random.default_rng(6)
    rows, vocab = 6, 700
    meta = _metadata(rng, rows, vocab, "temperature", 3,
                     temperature=[1.0, 1.0, 1.0, 1.0, 1e-4, 2.0],
                     top_k=[1, vocab, vocab + 5, 0, 0, 3],
                     top_p=[1.0, 1.0, 1.0, 1e-3, 1.0, 0.999],
                     min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    _run_and_compare(_logits(rng, rows, vocab, "float32"), meta)


def test_all_equal_logits_draw_by_uniform():
    """Every token ties: top-k keeps them all, and the draw lands at floor(u * vocab)."""
    rng = np.random.default_rng(7)
    rows, vocab = 5, 300
    meta = _metadata(rng, rows, vocab, "top_k", 0)
    result = sample(torch.full((rows, vocab), 0.25, device=DEVICE), TorchSampling.prepare(meta, DEVICE))
    np.testing.assert_array_equal(result.token_ids.cpu().numpy(), np.floor(meta.uniform.astype(np.float64) * vocab))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_takes_the_lowest_id_among_equal_maxima(dtype):
    rng = np.random.default_rng(8)
    rows, vocab = 6, 3 * ROW_BLOCK + 100
    logits = _logits(rng, rows, vocab, dtype)
    for row in range(rows):
        logits[row, rng.choice(vocab, size=row + 2, replace=False)] = 20.0
        first = rng.integers(0, ROW_BLOCK)  # and maxima one row block apart, which share a lane
        logits[row, [first, first + ROW_BLOCK, first + 2 * ROW_BLOCK]] = 20.0
    _run_and_compare(logits, _metadata(rng, rows, vocab, "greedy", 3))


@pytest.mark.parametrize("mode", ["greedy", "top_p", "combined"])
def test_rows_split_into_many_statistics_chunks_sample_as_the_oracle_does(monkeypatch, mode):
    """Blocks of 64 make a row of 1,000 eight programs' chunks of 128 (the last one partial): equal
    maxima in several chunks, a chunk of -inf, a row whose maximum is in the last chunk, a row all -inf
    but one token."""
    monkeypatch.setattr(sampling_kernel, "ROW_BLOCK", 64)
    rng = np.random.default_rng([14, len(mode)])
    rows, vocab = 6, 1000
    logits = _logits(rng, rows, vocab, "float32", tied=True)
    logits[0, [70, 300, 640, 999]] = 30.0
    logits[1, 128:256] = float("-inf")
    logits[2, 990] = 40.0
    logits[3] = float("-inf")
    logits[3, 517] = 1.0
    _run_and_compare(logits, _metadata(rng, rows, vocab, mode, 5))


def _split_search_forced(monkeypatch) -> list:
    """Every batch with a top-k or top-p filter searches in split passes, 128 logits a program; the
    list returned counts the searches."""
    monkeypatch.setattr(sampling_kernel, "CANDIDATE_ROWS", 0)
    monkeypatch.setattr(sampling_kernel, "SEARCH_CHUNK", 128)
    searches, search = [], sampling_kernel._split_search
    monkeypatch.setattr(sampling_kernel, "_split_search", lambda *args: searches.append(1) or search(*args))
    return searches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["top_k", "top_p", "combined"])
def test_batches_past_the_candidates_search_in_split_passes_as_the_oracle_samples(monkeypatch, dtype, mode):
    """Rows of 1,000 in eight programs' chunks of 128 (the last one partial), among them a row of equal
    logits, a tie of 200 at the top, a top-k past the vocabulary and greedy rows."""
    searches = _split_search_forced(monkeypatch)
    rng = np.random.default_rng([15, len(mode), list(DTYPES).index(dtype)])
    rows, vocab = 8, 1000
    logits = _logits(rng, rows, vocab, dtype, tied=mode == "top_k")
    logits[6] = 0.5
    logits[7, :200] = 12.0
    meta = _metadata(rng, rows, vocab, mode, 3)
    if mode != "top_p":
        meta.top_k[[1, 6]] = [vocab + 5, 300]
    _run_and_compare(logits, meta)
    assert searches == [1]


def _thresholds(values: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """In float64: among the weights top-k keeps, the largest at or above which they reach top_p of
    their sum."""
    weights = np.sort(np.exp((values - values.max()) / temperature))[::-1]
    kept = weights[:top_k] if 0 < top_k < len(weights) else weights
    if top_p >= 1:
        return kept[-1]
    return kept[np.searchsorted(np.cumsum(kept), top_p * kept.sum())]


def test_a_split_search_finds_the_threshold_a_float64_sort_finds(monkeypatch):
    rng = np.random.default_rng(16)
    rows, vocab = 6, 2000
    logits = _logits(rng, rows, vocab, "float32")
    meta = _metadata(rng, rows, vocab, "combined", 0, temperature=np.full(rows, 0.9))
    meta.top_k[:2] = 0  # top-p alone
    meta.top_p[2:4] = 1.0  # top-k alone
    params = TorchSampling.prepare(meta, DEVICE)
    _split_search_forced(monkeypatch)

    statistics = sampling_kernel._chunk_statistics_of(logits, params, ROW_BLOCK, scaled_sum=False)
    found = sampling_kernel._split_search(logits, params, statistics).cpu().numpy().view(np.float32)

    expected = [_thresholds(float64_values(logits)[row], 0.9, int(meta.top_k[row]), float(meta.top_p[row]))
                for row in range(rows)]
    np.testing.assert_allclose(found, expected, rtol=1e-5)


def test_zero_probability_tokens_are_never_drawn():
    """A draw of exactly 0 takes the first token with any probability, not a -inf one before it."""
    rng = np.random.default_rng(9)
    rows, vocab = 4, 600
    logits = _logits(rng, rows, vocab, "float32")
    logits[:, :3] = float("-inf")
    meta = _metadata(rng, rows, vocab, "temperature", 0)
    meta = SamplingMetadata(**{**vars(meta), "uniform": np.zeros(rows, np.float32)})
    result = sample(logits, TorchSampling.prepare(meta, DEVICE))
    np.testing.assert_array_equal(result.token_ids.cpu().numpy(), 3)


@pytest.mark.parametrize("mode", ["greedy", "combined", "combined, split search"])
def test_rows_of_nan_choose_an_id_inside_the_vocabulary(monkeypatch, mode):
    """A NaN row (conformance poisons inputs with them; on a GPU, an overflowed model makes them)
    matches no maximum: it must still pick an id inside the row, never read past it."""
    if mode.endswith("split search"):
        _split_search_forced(monkeypatch)
        mode = "combined"
    rng = np.random.default_rng(12)
    rows, vocab = 6, 3000
    logits = _logits(rng, rows, vocab, "float32")
    logits[1] = float("nan")
    logits[4, rng.choice(vocab, 10, replace=False)] = float("nan")
    meta = _metadata(rng, rows, vocab, mode, 2)
    tokens = sample(logits, TorchSampling.prepare(meta, DEVICE)).token_ids.cpu().numpy()
    assert np.all((tokens >= 0) & (tokens < vocab)), tokens


def test_rows_of_a_wider_tensor():
    """Logits rows that are a slice of a wider buffer (row stride larger than the vocabulary)."""
    rng = np.random.default_rng(10)
    wide = _logits(rng, 5, 1500, "float16")
    _run_and_compare(wide[:, :1200], _metadata(rng, 5, 1200, "combined", 4))


@contextlib.contextmanager
def _host_synchronisation_forbidden():
    """Every way torch code reads a device value back to the host raises while this is active."""
    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"{name} synchronises with the host")
        return refused

    original_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts):
            raise AssertionError("boolean-mask indexing has a data-dependent shape")
        return original_getitem(self, index)

    patches = {(torch.Tensor, name): refuse(f"Tensor.{name}")
               for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                            "masked_select", "unique", "numpy")}
    patches.update({(torch, name): refuse(f"torch.{name}") for name in ("nonzero", "masked_select", "unique")})
    patches[(torch.Tensor, "__getitem__")] = getitem
    saved = {key: getattr(*key) for key in patches}
    try:
        for (owner, name), replacement in patches.items():
            setattr(owner, name, replacement)
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@pytest.mark.parametrize("candidates", [64, sampling_kernel.CANDIDATES, "split search"])
def test_sampling_never_reads_a_device_value_back_to_the_host(monkeypatch, candidates):
    if candidates == "split search":
        searches = _split_search_forced(monkeypatch)
    else:
        monkeypatch.setattr(sampling_kernel, "CANDIDATES", candidates)
    rng = np.random.default_rng(11)
    meta = _metadata(rng, 6, 1000, "penalties", 5, top_k=rng.integers(1, 50, 6), top_p=np.full(6, 0.8),
                     min_p=np.full(6, 0.05))
    params = TorchSampling.prepare(meta, DEVICE)
    logits = _logits(rng, 6, 1000, "float16")
    with _host_synchronisation_forbidden():
        with pytest.raises(AssertionError):
            torch.ones(2).sum().item()  # the guard itself works
        result = sample(logits, params)
    assert result.token_ids.shape == (6,)
    assert candidates != "split search" or searches == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_whose_filter_reaches_past_the_candidates_search_the_whole_row(monkeypatch, dtype):
    """With 64 candidates over 1,000 tokens: rows whose top-k or top-p keeps fewer tokens draw among
    the candidates, the rest (top_k past them, a top_p that needs the long tail, a tie across the
    least candidate) search their whole row, all in one launch."""
    monkeypatch.setattr(sampling_kernel, "CANDIDATES", 64)
    rng = np.random.default_rng([13, list(DTYPES).index(dtype)])
    rows, vocab = 8, 1000
    logits = _logits(rng, rows, vocab, dtype)
    logits[6] = 0.5  # every token ties
    logits[7, :200] = 12.0  # a tie of 200 at the top
    meta = _metadata(rng, rows, vocab, "temperature", 3,
                     temperature=[1.0, 1.0, 2.0, 0.7, 1.0, 0.0, 1.0, 1.0],
                     top_k=[5, 100, 0, 0, 20, 0, 10, 30],
                     top_p=[1.0, 1.0, 0.999, 0.5, 0.8, 1.0, 1.0, 0.9],
                     min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0])
    reference = oracle.sample(float64_values(logits), meta)
    kept = reference["candidates"].sum(axis=1)
    assert (kept[[0, 3, 4]] < 64).all() and (kept[[1, 2, 6, 7]] >= 64).all(), kept
    _run_and_compare(logits, meta)
