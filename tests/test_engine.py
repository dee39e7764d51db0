"""The engine through the offline API: stopping rules, logprobs, n, abort, and bad requests."""

import json

import pytest

from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.engine.sampling_params import SamplingParams
from candelabra.core.llm import LLM
from conftest import available_backends, run_candelabra

PROMPT = [5, 9, 23, 42, 7, 11]
EOS = 1


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder, seed=5)
    return LLM(folder, backend="cpu", kvcache_mem_gpu=4, kvcache_mem_cpu=1, block_size=16)


def greedy(**options):
    return SamplingParams(temperature=0, **options)


def test_generate_keeps_prompt_order_and_counts(llm):
    outputs = llm.generate([PROMPT, PROMPT[:3], "w5 w6 w7"], greedy(max_tokens=5, ignore_eos=True), progress=False)
    assert [o.prompt_token_ids for o in outputs] == [PROMPT, PROMPT[:3], [5, 6, 7]]
    assert all(len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length" for o in outputs)
    # The text continues the prompt, so its first word comes with its space.
    assert outputs[0].outputs[0].text == "".join(f" w{t}" for t in outputs[0].outputs[0].token_ids)


def test_stop_string_cuts_the_text_and_ends_the_request(llm):
    full = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True), progress=False)[0].outputs[0]
    stop_word = f"w{full.token_ids[3]}"
    cut = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True, stop=[stop_word]), progress=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert stop_word not in cut.text.split() and full.text.startswith(cut.text.rstrip())
    assert cut.token_ids == full.token_ids[:4]


def test_stop_token_and_eos_end_without_entering_the_text(llm):
    full = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True), progress=False)[0].outputs[0]
    stopped = llm.generate(PROMPT, greedy(max_tokens=8, stop_token_ids=[full.token_ids[2]]), progress=False)[0]
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:3]
    assert f"w{full.token_ids[2]}" not in out.text.split()


def test_min_tokens_holds_off_eos_and_ignore_eos_ignores_it(llm):
    forced_eos = {EOS: 100.0}
    early = llm.generate(PROMPT, greedy(max_tokens=8, logit_bias=forced_eos), progress=False)[0].outputs[0]
    assert early.token_ids == [EOS] and early.finish_reason == "stop" and early.text == ""
    held = llm.generate(PROMPT, greedy(max_tokens=8, logit_bias=forced_eos, min_tokens=3), progress=False)[0]
    assert len(held.outputs[0].token_ids) == 4 and held.outputs[0].token_ids[-1] == EOS
    ignored = llm.generate(PROMPT, greedy(max_tokens=6, logit_bias=forced_eos, ignore_eos=True), progress=False)[0]
    assert ignored.outputs[0].token_ids == [EOS] * 6 and ignored.outputs[0].finish_reason == "length"


def test_logprobs_carry_the_chosen_token_and_the_top_ones(llm):
    out = llm.generate(PROMPT, greedy(max_tokens=4, ignore_eos=True, logprobs=3), progress=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for entry, token in zip(out.logprobs, out.token_ids):
        top = entry["top"]
        assert entry["token_id"] == token and len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely
        assert entry["logprob"] == pytest.approx(top[0][1]) and entry["logprob"] <= 0
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_n_samples_and_seeds(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=6, ignore_eos=True)
    first = llm.generate(PROMPT, params, progress=False)[0]
    again = llm.generate(PROMPT, params, progress=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_abort_frees_the_request_blocks(llm):
    engine = llm.engine
    engine.add_request("to-abort", PROMPT * 5, greedy(max_tokens=50, ignore_eos=True))
    engine.add_request("to-finish", PROMPT, greedy(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("to-abort")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_default_max_tokens_is_a_fifth_of_the_context(llm):
    out = llm.generate(PROMPT, greedy(ignore_eos=True), progress=False)[0].outputs[0]
    assert len(out.token_ids) == 512 // 5


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "the prompt is empty"),
    ([5] * 500, SamplingParams(max_tokens=20),
     r"prompt \(500 tokens\) plus max_tokens \(20\) exceeds .* \(512 tokens\)"),
    ([999], SamplingParams(), r"prompt token ids must lie in \[0, 160\)"),
])
def test_bad_requests_are_refused_with_a_reason(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert "bad" not in llm.engine.requests


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1, "temperature must be >= 0"), ("top_p", 0, r"top_p must be in \(0, 1\]"),
    ("n", 0, "n must be at least 1"), ("logprobs", 50, r"logprobs must be in \[0, 20\]"),
])
def test_bad_sampling_parameters_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.slow
@pytest.mark.parametrize("backend", available_backends())
def test_engine_conformance_passes(tmp_path, backend):
    results = tmp_path / "engine.json"
    run = run_candelabra("conformance", "--backend", backend, "--level", "engine", "--json", str(results))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    cases = json.loads(results.read_text())["engine"]
    assert [c["status"] for c in cases] == ["passed"] * 6
