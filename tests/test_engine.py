"""The engine through the offline API: stopping rules, logprobs, n, abort, and bad requests."""

import json

import pytest

from candelabra.conformance.engine_cases import ENGINE_CASES
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.plugins import backend_class
from support import available_backends, run_candelabra

PROMPT = [5, 9, 23, 42, 7, 11]
EOS = 1


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(seed=5, kvcache_mem_cpu=1)


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
        top = entry.top
        assert entry.token_id == token and len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(top[0][1]) and entry.logprob <= 0
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
def test_every_engine_conformance_case_passes_on_each_available_backend(tmp_path, backend):
    results = tmp_path / "engine.json"
    run = run_candelabra("conformance", "--backend", backend, "--level", "engine", "--json", str(results))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    cases = json.loads(results.read_text())["engine"]
    declared = backend_class(backend).kv_cache_dtypes("float32")  # the cases over a quantized cache need it
    assert [c["status"] for c in cases] == ["passed" if case.kv_cache_dtype in (None, *declared) else "not supported"
                                            for case in ENGINE_CASES]


def test_greedy_tokens_part_on_a_tie_only_where_the_lone_runs_best_led_by_at_most_the_margin(tmp_path):
    from candelabra.conformance.engine_cases import _Harness, parting_tie, write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, seed=17)
    h = _Harness(backend_class("cpu")(), tmp_path, "float32")
    params, prompt, step = greedy(max_tokens=8, ignore_eos=True), PROMPT + [30, 31], 3
    lone = h.alone([prompt], greedy(max_tokens=8, ignore_eos=True, logprobs=2))[0].outputs[0]
    (best, best_logprob), (second, second_logprob) = lone.logprobs[step].top[:2]
    lead = best_logprob - second_logprob
    parted = lone.token_ids[:step] + [second] + lone.token_ids[step + 1:]

    assert best == lone.token_ids[step] and lead > 0
    assert parting_tie(h, prompt, params, parted, lone.token_ids, lead * 1.01, {}) == step
    assert parting_tie(h, prompt, params, parted, lone.token_ids, lead * 0.99, {}) is None
    unlikely = next(t for t in range(2, 160) if t not in dict(lone.logprobs[step].top))
    assert parting_tie(h, prompt, params, parted[:step] + [unlikely], lone.token_ids, 100.0, {}) is None
    # Tokens that are not what the prompt gets alone are no reference to part from.
    assert parting_tie(h, prompt, params, parted, parted[:step] + [best, best, best], 100.0, {}) is None


def test_a_pick_may_part_where_reading_the_tokens_so_far_as_a_prompt_gives_it_but_not_under_penalties(tmp_path):
    from candelabra.conformance.engine_cases import _Harness, prefix_read_agrees, write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, seed=19)
    h = _Harness(backend_class("cpu")(), tmp_path, "float32")
    params, prompt, step = greedy(max_tokens=8, ignore_eos=True), PROMPT + [40, 41], 5
    lone = h.alone([prompt], greedy(max_tokens=8, ignore_eos=True, logprobs=2))[0].outputs[0]
    # read as one prompt, the first 5 tokens give the 6th its logprobs again, to float32's rounding
    read = h.alone([prompt + lone.token_ids[:step]], greedy(max_tokens=1, logprobs=2))[0].outputs[0]
    (best, best_logprob), (second, second_logprob) = read.logprobs[0].top[:2]
    assert best == lone.token_ids[step]
    assert abs(best_logprob - dict(lone.logprobs[step].top)[best]) < 1e-4

    lead = best_logprob - second_logprob
    parted = lone.token_ids[:step] + [second]
    assert prefix_read_agrees(h, prompt, params, lone.token_ids, step, 0.0, {})
    assert prefix_read_agrees(h, prompt, params, parted, step, lead * 1.01, {})
    assert not prefix_read_agrees(h, prompt, params, parted, step, lead * 0.99, {})
    # a penalty weighs generated tokens and not the prompt's: read as a prompt they are no reference
    penalised = greedy(max_tokens=8, ignore_eos=True, frequency_penalty=0.5)
    assert not prefix_read_agrees(h, prompt, penalised, lone.token_ids, step, 100.0, {})


def test_one_device_to_host_transfer_per_step(llm, monkeypatch):
    """Everything a step returns reaches the host through one `fetch`; nothing else reads the
    device during the step."""
    backend, counts = llm.backend, {"fetch": 0, "to_host": 0}
    real_fetch, real_to_host = backend.fetch, backend.to_host
    inside_fetch = []

    def fetch(*tensors):
        counts["fetch"] += 1
        inside_fetch.append(True)
        try:
            return real_fetch(*tensors)
        finally:
            inside_fetch.pop()

    def to_host(tensor):
        if not inside_fetch:
            counts["to_host"] += 1
        return real_to_host(tensor)

    monkeypatch.setattr(backend, "fetch", fetch)
    monkeypatch.setattr(backend, "to_host", to_host)
    engine = llm.engine
    engine.add_request("a", PROMPT, greedy(max_tokens=6, ignore_eos=True, logprobs=2))
    engine.add_request("b", PROMPT[:4], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=5, ignore_eos=True,
                                                       repetition_penalty=1.2, frequency_penalty=0.5))
    engine.add_request("c", PROMPT[1:], greedy(max_tokens=3, ignore_eos=True, prompt_logprobs=3))  # scores the prompt
    steps = 0
    while engine.has_unfinished_requests():
        before = dict(counts)
        engine.step()
        steps += 1
        assert (counts["fetch"] - before["fetch"], counts["to_host"] - before["to_host"]) == (1, 0)
    assert steps >= 6


def test_a_backend_that_runs_steps_at_fixed_padded_sizes_passes_the_engine_level(tmp_path):
    import os
    from pathlib import Path

    tests = str(Path(__file__).parent)
    result = run_candelabra("conformance", "--backend", "padded_backend:PaddedCpuBackend", "--level", "engine",
                            "--json", str(tmp_path / "engine.json"),
                            env_extra={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stdout + result.stderr
    cases = json.loads((tmp_path / "engine.json").read_text())["engine"]
    assert len(cases) >= 6 and all(c["status"] == "passed" for c in cases)


def test_a_padding_backend_generates_what_the_reference_does_and_really_pads(llm, tiny_llm):
    from padded_backend import SIZES, PaddedCpuBackend

    padded = tiny_llm(seed=5, backend=PaddedCpuBackend, kvcache_mem_cpu=1)
    prompts = [PROMPT, PROMPT[:2], list(range(3, 40))]
    params = [greedy(max_tokens=7, ignore_eos=True), SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=5),
              greedy(max_tokens=3, ignore_eos=True, logprobs=2)]
    ours = padded.generate(prompts, params, progress=False)
    reference = llm.generate(prompts, params, progress=False)
    assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in reference]
    shapes = padded.engine.runner.executor.shapes
    assert shapes and all(tokens in SIZES and rows in (0, *SIZES) for tokens, _, rows in shapes)


def test_the_executor_warms_up_once_before_the_first_step_for_the_engine_batch_limit(tiny_llm):
    from padded_backend import PaddedCpuBackend

    padded = tiny_llm(seed=5, backend=PaddedCpuBackend, max_num_seqs=5)
    padded.generate([PROMPT], greedy(max_tokens=3), progress=False)
    executor = padded.engine.runner.executor
    assert executor.warm_ups == [(5, 0)] and executor.shapes


def test_padded_steps_sample_what_unpadded_steps_do(tiny_llm):
    """A mixed step (a decode beside a chunk of prefill), padded, gives the same tokens and
    logprobs in its real rows as unpadded, and writes nothing to the cache for its padding."""
    import numpy as np

    from candelabra.core.contract.executor import StepExecutor, StepInputs, pad_step_inputs
    from candelabra.core.contract.step_metadata import StepMetadata
    from candelabra.core.worker.model_runner import ModelRunner
    from candelabra.core.worker.sampling_inputs import sampling_metadata
    from padded_backend import PaddedCpuBackend

    llm = tiny_llm(seed=9, backend=PaddedCpuBackend)
    rng = np.random.default_rng(4)
    first, second = rng.integers(2, 150, 20).tolist(), rng.integers(2, 150, 30).tolist()
    runner = ModelRunner(llm.model, num_blocks=8, block_size=16)
    runner.logits(np.array(first[:19] + second[:12]), StepMetadata.build([19, 12], [19, 12], [[5, 2], [7, 0]], 16))
    meta = llm.model.with_rope_positions(StepMetadata.build([1, 18], [20, 30], [[5, 2], [7, 0]], 16))
    seqs = [_sequence(first, 0.0), _sequence(second, 0.7)]
    inputs = StepInputs(np.array(first[19:] + second[12:], np.int32), meta, sampling_metadata(seqs))
    untouched = [c.key.copy() for c in runner.caches]
    executor = StepExecutor(llm.backend, llm.model)
    plain = executor.run(inputs, [c._replace(key=c.key.copy(), value=c.value.copy()) for c in runner.caches])[0].sampled
    padded_inputs = pad_step_inputs(inputs, 32, 15, 8)
    assert np.all(padded_inputs.step.slot_mapping[19:] == -1)
    padded_result, caches = executor.run(padded_inputs, runner.caches)
    padded = padded_result.sampled
    np.testing.assert_array_equal(plain.token_ids, padded.token_ids[:2])
    np.testing.assert_array_equal(plain.top_token_ids, padded.top_token_ids[:2])
    # BLAS sums a batch of another size in another order: the logprobs agree to float32 rounding.
    np.testing.assert_allclose(plain.logprobs, padded.logprobs[:2], rtol=1e-5)
    np.testing.assert_allclose(plain.top_logprobs, padded.top_logprobs[:2], rtol=1e-5)
    written = {int(s) for s in meta.slot_mapping}
    for layer, before in zip(caches, untouched):
        changed = {int(s) for s in np.flatnonzero(np.any(layer.key.reshape(-1, layer.key[0, 0].size) !=
                                                         before.reshape(-1, before[0, 0].size), axis=1))}
        assert changed <= written


def _sequence(tokens, temperature):
    import numpy as np

    from candelabra.core.requests.sequence import Sequence

    return Sequence("r", 0, tokens, SamplingParams(temperature=temperature, logprobs=3), 0, np.random.default_rng(1))


def test_a_loaded_model_is_kept_out_of_full_garbage_collections_until_it_is_closed(tiny_llm):
    """A full collection scanning the loaded objects stalled a decode step for over 100 ms: LLM freezes what
    exists once its engine is built (after collecting the garbage), and close() gives it back."""
    import gc

    llm = tiny_llm(seed=5)
    assert gc.get_freeze_count() > 10_000  # torch, the model and the engine, at least
    llm.close()
    assert gc.get_freeze_count() == 0
