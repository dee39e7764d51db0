"""bench/quality_vs_reference.py's measures (KL, KL with a lumped tail, top-1 agreement, windows) against
float64 oracles written row by row, on random distributions."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "quality_vs_reference.py"


def load_script():
    spec = importlib.util.spec_from_file_location("quality_vs_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


quality = load_script()


def random_logprobs(rng, rows=6, vocab=50, spread=3.0):
    logits = rng.normal(scale=spread, size=(rows, vocab))
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def oracle_kl(p_row, q_row):
    return math.fsum(p * math.log(p / q) for p, q in zip(p_row, q_row) if p > 0)


def oracle_lumped_kl(reference_row, top_ids, tested_top_logprobs):
    """KL over the buckets: each listed token, then everything else, on each side."""
    p = [math.exp(reference_row[token]) for token in top_ids]
    q = [math.exp(value) for value in tested_top_logprobs]
    p.append(max(1.0 - math.fsum(p), 0.0))
    q.append(max(1.0 - math.fsum(q), quality.REST_FLOOR))
    return oracle_kl(p, q)


@pytest.mark.parametrize("seed", range(5))
def test_log_softmax_gives_rows_of_log_probabilities_in_float64(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=10, size=(4, 30)).astype(np.float32)
    logprobs = quality.log_softmax(logits)
    assert logprobs.dtype == np.float64
    for row, logit_row in zip(logprobs, logits.astype(np.float64)):
        total = math.fsum(math.exp(value) for value in logit_row)
        assert row == pytest.approx([value - math.log(total) for value in logit_row], abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_full_kl_matches_a_row_by_row_oracle(seed):
    rng = np.random.default_rng(seed)
    reference, tested = random_logprobs(rng), random_logprobs(rng)
    expected = [oracle_kl(np.exp(p), np.exp(q)) for p, q in zip(reference, tested)]
    assert quality.kl_divergence(reference, tested) == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_a_distribution_has_no_divergence_from_itself():
    logprobs = random_logprobs(np.random.default_rng(0))
    ids, top = quality.top_n(logprobs, 5)
    assert quality.kl_divergence(logprobs, logprobs) == pytest.approx(0.0, abs=1e-12)
    assert quality.lumped_kl(logprobs, ids, top) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_top_n_gives_the_most_likely_tokens_most_likely_first(seed):
    logprobs = random_logprobs(np.random.default_rng(seed))
    ids, values = quality.top_n(logprobs, 7)
    for row, row_ids, row_values in zip(logprobs, ids, values):
        assert list(row_ids) == list(np.argsort(-row, kind="stable")[:7])
        assert list(row_values) == list(row[row_ids])


@pytest.mark.parametrize("seed", range(5))
def test_lumped_kl_matches_an_oracle_over_the_top_tokens_and_one_bucket_for_the_rest(seed):
    rng = np.random.default_rng(seed)
    reference, tested = random_logprobs(rng), random_logprobs(rng)
    ids, top = quality.top_n(tested, 8)
    expected = [oracle_lumped_kl(r, i, t) for r, i, t in zip(reference, ids, top)]
    assert quality.lumped_kl(reference, ids, top) == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_lumping_the_tail_never_raises_the_kl(seed):
    rng = np.random.default_rng(seed)
    reference, tested = random_logprobs(rng), random_logprobs(rng)
    full = quality.kl_divergence(reference, tested)
    for n in (1, 4, 20, 49):
        ids, top = quality.top_n(tested, n)
        # the rest bucket's 1 - sum loses a few ulps, so lumping one token may land a hair above
        assert np.all(quality.lumped_kl(reference, ids, top) <= full * (1 + 1e-9))


def test_lumped_kl_over_the_whole_vocabulary_is_the_full_kl():
    rng = np.random.default_rng(1)
    reference, tested = random_logprobs(rng), random_logprobs(rng)
    ids, top = quality.top_n(tested, tested.shape[1])
    assert quality.lumped_kl(reference, ids, top) == pytest.approx(quality.kl_divergence(reference, tested),
                                                                    rel=1e-9, abs=1e-12)


def test_lumped_kl_stays_finite_when_the_tested_top_tokens_round_past_all_the_mass():
    reference = np.log(np.array([[0.999, 0.0009, 0.0001]]))
    ids = np.array([[0, 1]])
    tested_top = np.log(np.array([[0.9995, 0.0006]]))  # sums past 1, as float32 probabilities can
    kl = quality.lumped_kl(reference, ids, tested_top)
    assert np.isfinite(kl).all()
    assert kl == pytest.approx([oracle_lumped_kl(reference[0], ids[0], tested_top[0])], rel=1e-10)


def test_top1_agreement_marks_the_rows_whose_first_tokens_match():
    rng = np.random.default_rng(2)
    reference = random_logprobs(rng, rows=40)
    tested_first = reference.argmax(axis=-1)
    changed = rng.random(40) < 0.5
    tested_first[changed] = (tested_first[changed] + 1) % reference.shape[1]
    assert list(quality.top1_agreement(reference, tested_first)) == list(~changed)


@pytest.mark.parametrize("length, window", [(0, 4), (1, 4), (7, 7), (8, 3), (100, 16), (5, 1)])
def test_windows_cover_the_tokens_in_order_and_only_the_last_is_shorter(length, window):
    tokens = list(np.random.default_rng(length).integers(0, 1000, length))
    windows = quality.cut_windows(tokens, window)
    assert [int(token) for part in windows for token in part] == [int(token) for token in tokens]
    assert all(len(part) == window for part in windows[:-1])
    assert all(0 < len(part) <= window for part in windows)


def test_a_window_of_no_tokens_is_refused():
    with pytest.raises(ValueError):
        quality.cut_windows([1, 2, 3], 0)


def test_a_summary_pools_the_positions_of_every_window():
    rng = np.random.default_rng(3)
    scores = quality.PathScores("tested", "full vocabulary")
    windows = [(rng.exponential(size=size), rng.random(size) < 0.9) for size in (16, 16, 5)]
    for kl, agreement in windows:
        scores.add_window(kl, agreement)
    summary = scores.summary()
    every_kl = np.concatenate([kl for kl, _ in windows])
    assert summary["positions"] == 37
    assert summary["mean_kl"] == pytest.approx(every_kl.mean(), rel=1e-12)
    assert summary["p99_kl"] == pytest.approx(np.percentile(every_kl, 99), rel=1e-12)
    assert summary["top1_agreement"] == pytest.approx(np.mean(np.concatenate([a for _, a in windows])))
    assert [window["positions"] for window in summary["windows"]] == [16, 16, 5]


@pytest.mark.parametrize("rows_per_step", [1, 5])
def test_a_window_run_in_steps_through_the_cache_scores_as_one_prefill_step_does(tmp_path, rows_per_step):
    """--rows-per-step: each step reads the earlier positions from the KV cache, as serve's decodes do, and
    the log-probabilities of all 37 positions (blocks of 16, so steps cross blocks) are the one step's."""
    from candelabra.conformance.engine_cases import write_tiny_checkpoint
    from candelabra.core.llm import open_model

    write_tiny_checkpoint(tmp_path, seed=29)
    window = np.random.default_rng(30).integers(0, 160, size=37)
    with open_model(str(tmp_path)) as checkpoint:
        whole = quality.CandelabraScorer(checkpoint, "cpu", "float32", window=64).logprobs(window)
        stepped = quality.CandelabraScorer(checkpoint, "cpu", "float32", window=64, rows_per_step=rows_per_step)
        in_steps = stepped.logprobs(window)
    assert in_steps.shape == whole.shape == (37, 160)
    np.testing.assert_allclose(in_steps, whole, atol=1e-4)
    assert quality.kl_divergence(whole, in_steps).max() < 1e-8


def test_a_llama_server_whose_slot_is_shorter_than_the_window_is_named_with_the_fix():
    import json

    import httpx

    refusal = "request (512 tokens) exceeds the available context size (512 tokens), try increasing it"
    top = [{"id": token, "logprob": -1.0 - token} for token in range(4)]

    def answer(request):  # as llama-server with -np 16 -c 8192 answers: 512 tokens a slot
        if len(json.loads(request.content)["prompt"]) >= 512:
            return httpx.Response(400, json={"error": {"code": 400, "message": refusal}})
        return httpx.Response(200, json={"completion_probabilities": [{"top_logprobs": top}]})

    scorer = quality.LlamaServerScorer("http://llama-server.test", n=4)
    scorer.client = httpx.Client(base_url="http://llama-server.test", transport=httpx.MockTransport(answer))
    assert scorer.top_logprobs(np.arange(3))[0].tolist() == [[0, 1, 2, 3]] * 3
    with pytest.raises(RuntimeError, match=r"refused a prompt of 512 tokens: .*exceeds the available context.*-np 1"):
        scorer.top_logprobs(np.arange(512))
