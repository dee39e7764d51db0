"""Prompt logprobs through the engine: each prompt token scored against transformers' log-softmax of
its own logits, whether the prompt runs whole or chunked, alone or batched, from the prefix cache
or recomputed after preemption."""

import numpy as np
import pytest

from candelabra.conformance.engine_cases import VOCAB, write_tiny_checkpoint
from candelabra.core.engine.engine import EngineConfig, LLMEngine
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.loading.model import load_model
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.plugins import installed_plugins
from support import available_backends
from transformers_reference import log_softmax_at_each_position

BLOCK = 16
WORDS = {0: "<unk>", 1: "<eos>"}  # the tiny tokenizer's special tokens; the others read "w<id>"
# float32 logits through different summation orders agree to about this much
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path, seed=11)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    """Transformers' log-softmax over each position's logits, for a prompt."""
    return log_softmax_at_each_position(folder)


@pytest.fixture(scope="module", params=available_backends())
def engine_for(request, folder):
    backend = installed_plugins().backends.get(request.param)()
    checkpoint = SafetensorsCheckpoint(folder)
    model, tokenizer = load_model(checkpoint, backend, "float32"), Tokenizer.from_checkpoint(checkpoint)

    def engine(**options) -> LLMEngine:
        config = EngineConfig(**{"num_blocks": 64, "block_size": BLOCK, **options})
        return LLMEngine(ModelRunner(model, config.num_blocks, config.block_size), tokenizer, config)

    return engine


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[f"r{i}"] for i in range(len(prompts))]


def scored(k: int | None, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, **options)


def check_against_reference(output, reference, k: int) -> None:
    prompt = output.prompt_token_ids
    expected = reference(prompt)
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        row, token, entry = expected[position - 1], prompt[position], entries[position]
        assert token in entry
        assert entry[token].logprob == pytest.approx(row[token], abs=TOLERANCE)
        assert entry[token].rank == 1 + int(np.sum(row > row[token] + TOLERANCE)) or \
            entry[token].rank == 1 + int(np.sum(row > row[token]))
        alternatives = sorted(((lp.rank, t) for t, lp in entry.items() if t != token or lp.rank <= k))
        top = [t for _, t in alternatives][:k]
        assert len(entry) in (k, k + 1)
        np.testing.assert_allclose([entry[t].logprob for t in top], np.sort(row)[::-1][:k], atol=TOLERANCE)
        # A word-level tokenizer: each token reads as its own word, after a space.
        assert {t: lp.decoded_token for t, lp in entry.items()} == {t: " " + WORDS.get(t, f"w{t}") for t in entry}


def test_whole_prompt_matches_transformers(engine_for, reference):
    prompt = np.random.default_rng(1).integers(2, VOCAB, 21).tolist()
    [output] = run(engine_for(prefill_chunk_size=0), [prompt], [scored(3)])
    check_against_reference(output, reference, 3)


def test_chunked_and_batched_prompts_match_transformers(engine_for, reference):
    """Chunks of 7 tokens under a budget of 12 a step: each chunk's last token is scored against
    the first of the next, and the prompts share steps with one that asks for nothing."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (30, 17, 25)]
    outputs = run(engine_for(prefill_chunk_size=7, max_num_batched_tokens=12), prompts,
                  [scored(2), scored(None), scored(0)])
    check_against_reference(outputs[0], reference, 2)
    assert outputs[1].prompt_logprobs is None
    check_against_reference(outputs[2], reference, 0)


def test_prefix_cache_hits_do_not_skip_scoring(engine_for, reference):
    prompt = np.random.default_rng(3).integers(2, VOCAB, 3 * BLOCK + 5).tolist()
    engine = engine_for()
    run(engine, [prompt], [scored(None)])  # fills the prefix cache
    [again] = run(engine, [prompt], [scored(1)])
    check_against_reference(again, reference, 1)
    assert again.num_cached_tokens == 0
    [unscored] = run(engine, [prompt], [scored(None)])
    assert unscored.num_cached_tokens == 3 * BLOCK  # the cache itself still serves the others


def test_preempted_and_recomputed_prompts_are_scored_once(engine_for, reference):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, VOCAB, 40).tolist() for _ in range(6)]
    engine = engine_for(num_blocks=10, preemption="recompute", prefill_chunk_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outputs = run(engine, prompts, [params] * len(prompts))
    assert engine.core.scheduler.num_preemptions["recompute"] > 0
    for output in outputs:
        check_against_reference(output, reference, 1)


def test_parallel_samples_share_the_prompts_scores(engine_for, reference):
    prompt = np.random.default_rng(5).integers(2, VOCAB, 12).tolist()
    [output] = run(engine_for(), [prompt], [SamplingParams(n=3, temperature=0.8, max_tokens=4, prompt_logprobs=2)])
    assert len(output.outputs) == 3
    check_against_reference(output, reference, 2)


@pytest.mark.parametrize("bad", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=bad)
