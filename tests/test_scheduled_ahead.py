"""Async scheduling: each step scheduled and launched before the step in flight has returned its tokens.
Everything a request gets must be what it gets with steps in turn; what differs is only when."""

from __future__ import annotations

import json

import numpy as np
import pytest

from candelabra.core.requests.sampling_params import SamplingParams, StructuredOutput
from candelabra.core.requests.sequence import PENDING_TOKEN, Sequence, sample_rng
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.scheduler import Scheduler
from candelabra.core.worker.model_runner import ModelRunner, _token_feed
from support import available_backends

PROMPTS = [[5, 9, 23, 42, 7, 11], [3, 4, 5], list(range(2, 40)), [7] * 20, [12, 13], [7] * 20]


def mixed_params(stop_token: int, stop_word: str) -> list[SamplingParams]:
    """One request of each kind: greedy to its length, seeded sampling ending on its end token, n = 3
    with logprobs, a stop token and a stop string, and penalties (whose steps wait for the tokens)."""
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9),
            SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=7, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=10, stop=[stop_word]),
            SamplingParams(temperature=0.7, seed=11, max_tokens=8, ignore_eos=True, repetition_penalty=1.2,
                           presence_penalty=0.5, prompt_logprobs=1, min_tokens=3),
            SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token])]


def outcome(outputs) -> list:
    return [[(o.token_ids, o.finish_reason, o.text, [(lp.token_id, lp.top) for lp in o.logprobs or []])
             for o in r.outputs] for r in outputs]


@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("cpu", "torch", "metal")])
def test_requests_of_every_kind_get_what_they_get_with_steps_in_turn(tiny_llm, backend):
    in_turn = tiny_llm(seed=5, backend=backend, dtype="float32")
    greedy = in_turn.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                              progress=False)[0].outputs[0].token_ids
    # a stop string and a stop token the greedy requests meet on their way
    stop_token, stop_word = greedy[6], f" w{greedy[3]}"
    params = mixed_params(stop_token, stop_word)
    expected = in_turn.generate(PROMPTS, params, progress=False)
    ahead = tiny_llm(seed=5, backend=backend, dtype="float32", async_scheduling=True)
    got = ahead.generate(PROMPTS, params, progress=False)

    assert outcome(got) == outcome(expected)
    by_string, by_token = got[3].outputs[0], got[5].outputs[0]
    assert by_string.finish_reason == "stop" and len(by_string.token_ids) < 10 and stop_word not in by_string.text
    assert by_token.finish_reason == "stop" and by_token.token_ids[-1] == stop_token
    for r, e in zip(got, expected):
        assert (r.prompt_logprobs is None) == (e.prompt_logprobs is None)
        if e.prompt_logprobs is not None:
            assert [sorted(d) if d else d for d in r.prompt_logprobs] == [sorted(d) if d else d
                                                                          for d in e.prompt_logprobs]
    blocks = ahead.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_request_aborted_or_ended_while_its_next_step_runs_leaves_nothing_behind(tiny_llm):
    llm = tiny_llm(seed=5, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for name, prompt in zip("abc", PROMPTS):
        engine.add_request(name, prompt, params)
    steps = [engine.step() for _ in range(4)]
    assert engine.core._in_flight is not None
    engine.abort_request("b")  # its pending token is dropped, its blocks freed while the step runs
    engine.core.finish_sample("c", 0)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    for outputs in steps:
        for output in outputs:
            tokens[output.request_id] = output.outputs[0].token_ids
    lone = tiny_llm(seed=5).generate(PROMPTS[0], params, progress=False)[0].outputs[0].token_ids
    assert tokens["a"] == lone
    assert len(tokens["b"]) == len(tokens["c"]) == 3  # the steps that reached the host before they ended
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(PENDING_TOKEN not in seq.token_ids for request in engine.core.requests.values()
               for seq in request.sequences)


def test_generated_text_reaches_the_prefix_cache_as_it_does_with_steps_in_turn(tiny_llm):
    """A block that a pending token completes is hashed once the token is known: a second prompt that
    repeats the first's generated text reuses the same cached tokens either way."""
    prompt = list(range(2, 30))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hits = []
    for ahead in (False, True):
        llm = tiny_llm(seed=5, async_scheduling=ahead)
        first = llm.generate(prompt, params, progress=False)[0].outputs[0].token_ids
        second = llm.generate(prompt + first + [3], SamplingParams(temperature=0, max_tokens=2), progress=False)[0]
        hits.append(second.num_cached_tokens)
    assert hits[0] == hits[1] >= 64


def test_structured_output_waits_for_each_token_and_keeps_to_its_grammar(tiny_llm, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False}))
    params = SamplingParams(n=4, temperature=1.5, seed=4, max_tokens=8, ignore_eos=True,
                            structured_output=StructuredOutput(regex=r"(ab|c)+d"))
    free = SamplingParams(n=2, temperature=1.5, seed=3, max_tokens=6, ignore_eos=True)
    results = [tiny_llm(folder=tmp_path, load_format="dummy", async_scheduling=ahead).generate(
        [[5, 9, 23], [42, 7, 11]], [params, free], progress=False) for ahead in (False, True)]
    assert outcome(results[1]) == outcome(results[0])


@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("cpu", "torch")])
def test_steps_are_scheduled_ahead_by_default_only_where_the_device_runs_apart_from_the_host(tiny_llm, backend):
    """A CPU backend computes as it is called: in turn by default. The same backend saying its device runs
    apart from the host (as cuda's does) gets its steps scheduled ahead, and the same tokens."""
    llm = tiny_llm(seed=5, backend=backend, dtype="float32")
    assert llm.backend.runs_apart_from_host() is False
    assert llm.engine.core.config.async_scheduling is False

    llm.backend.runs_apart_from_host = lambda: True
    ahead, in_turn = engine_over(llm), engine_over(llm, async_scheduling=False)
    assert ahead.core.config.async_scheduling is True and in_turn.core.config.async_scheduling is False
    rng = np.random.default_rng(8)
    prompts = [rng.integers(2, 160, int(n)).tolist() for n in rng.integers(5, 30, 5)]
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=9)
    arrivals = [0, 0, 1, 3, 4]
    assert run_all(ahead, prompts, params, arrivals) == run_all(in_turn, prompts, params, arrivals)
    for engine in (ahead, in_turn):
        engine.add_request("first", prompts[0], params)
    # a step ahead returns the tokens of the step launched before it: the first returns none
    assert ahead.step() == [] and [o.request_id for o in in_turn.step()] == ["first"]


def test_a_torch_device_of_its_own_runs_apart_from_the_host():
    from candelabra.backends.torch.placement import DevicePlacement, HostPlacement

    assert DevicePlacement.runs_apart_from_host is True and HostPlacement.runs_apart_from_host is False


# the books: pending tokens in the scheduler and the block manager


def sequence(prompt, max_tokens=8) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Sequence("r", 0, prompt, params, 0, sample_rng(0, 0), max_tokens=max_tokens, end_token_ids=frozenset({1}))


def test_a_block_completed_by_a_pending_token_is_cached_under_its_real_tokens_once_known():
    def run(ahead: bool) -> dict:
        blocks = BlockManager(num_blocks=8, block_size=4)
        scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
        seq = sequence([5, 6, 7])
        scheduler.add(seq)
        in_flight = None
        for token in (8, 9, 10, 11, 12):  # 8 completes the first block, computed by the step after its own
            plan = scheduler.schedule()
            scheduler.commit(plan)
            if not ahead:
                scheduler.resolve(plan, [_sampled(token)])
                continue
            if in_flight is not None:
                if in_flight[1] == 8:  # the step computing token 8 is launched, 8 itself not yet known
                    assert seq.token_ids[3] == PENDING_TOKEN and not blocks._block_by_hash
                scheduler.resolve(in_flight[0], [_sampled(in_flight[1])])
            in_flight = (plan, token)
        if in_flight is not None:
            scheduler.resolve(in_flight[0], [_sampled(in_flight[1])])
        assert seq.token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
        return dict(blocks._block_by_hash)

    assert run(ahead=True) == run(ahead=False) and len(run(ahead=False)) == 1


def test_a_sequence_whose_last_token_is_pending_is_not_scheduled_again():
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    seq = sequence([5, 6, 7], max_tokens=2)
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.commit(first)
    second = scheduler.schedule()
    scheduler.commit(second)
    assert seq.token_ids == [5, 6, 7, PENDING_TOKEN, PENDING_TOKEN]
    assert not scheduler.schedule().scheduled  # both its tokens are on their way
    scheduler.resolve(first, [_sampled(8)])
    scheduler.resolve(second, [_sampled(9)])
    assert seq.is_finished and seq.finish_reason == "length" and seq.token_ids == [5, 6, 7, 8, 9]
    assert blocks.num_free_blocks == 8


def test_an_end_token_drops_the_token_pending_after_it():
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    seq = sequence([5, 6, 7])
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.commit(first)
    second = scheduler.schedule()
    scheduler.commit(second)
    assert scheduler.resolve(first, [_sampled(1)]) == [(seq, _sampled(1))]  # its end token
    assert seq.token_ids == [5, 6, 7, 1] and seq.finish_reason == "stop" and blocks.num_free_blocks == 8
    assert scheduler.resolve(second, [_sampled(9)]) == []


def _sampled(token_id: int):
    from candelabra.core.requests.tokens import SampledToken

    return SampledToken(token_id, -0.5, [])


def test_the_step_feeds_each_pending_token_from_its_row_in_the_step_before(tiny_llm):
    llm = tiny_llm(seed=5, async_scheduling=True)
    core = llm.engine.core
    for name, prompt in zip("ab", PROMPTS):
        llm.engine.add_request(name, prompt, SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True))
    core.step()
    previous = core._in_flight
    plan = core.scheduler.schedule()
    inputs = core.runner.order(plan).inputs
    feed = _token_feed(plan, inputs, previous)
    rows = {s.seq_id: row for row, (_, s) in enumerate(previous.plan.sampled)}
    assert feed.rows.tolist() == [rows[item.seq.seq_id] for item in plan.scheduled]
    assert feed.positions.tolist() == list(range(len(plan.scheduled)))
    assert np.all(inputs.token_ids[feed.positions] == PENDING_TOKEN)


def engine_over(llm, **options):
    """A fresh engine over `llm`'s model, with `options` for its EngineConfig."""
    from candelabra.core.engine.engine import EngineConfig, LLMEngine

    config = EngineConfig(**{"block_size": 16, "num_blocks": 64, **options})
    return LLMEngine(ModelRunner(llm.model, config.num_blocks, config.block_size), llm.tokenizer, config)


def run_all(engine, prompts, params, arrivals) -> list:
    finished, step, waiting = {}, 0, sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while waiting or engine.has_unfinished_requests():
        while waiting and arrivals[waiting[0]] <= step:
            i = waiting.pop(0)
            engine.add_request(str(i), prompts[i], params)
        finished.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
        step += 1
    return [finished[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("options", [dict(num_blocks=10, num_host_blocks=40, preemption="swap"),
                                     dict(num_blocks=10, preemption="recompute"),
                                     dict(prefill_chunk_size=5, max_num_batched_tokens=24)],
                         ids=["preempt-swap", "preempt-recompute", "chunked-prefill"])
def test_preempted_and_chunked_requests_get_what_they_get_in_turn(tiny_llm, options):
    """Preemptions (by swap and by recompute) of requests whose tokens are pending, and prefills in chunks
    beside decodes: the same tokens either way, and every block back at the end."""
    llm = tiny_llm(seed=5, dtype="float32")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 160, int(n)).tolist() for n in rng.integers(20, 45, 8)]
    arrivals = sorted(rng.integers(0, 12, len(prompts)).tolist())
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[int(rng.integers(2, 160))])
    results, engines = [], []
    for ahead in (False, True):
        engine = engine_over(llm, async_scheduling=ahead, **options)
        results.append(run_all(engine, prompts, params, arrivals))
        engines.append(engine)
    assert results[1] == results[0]
    for engine in engines:
        blocks = engine.core.blocks
        assert blocks.num_free_blocks == blocks.num_blocks and blocks.num_free_host_blocks == blocks.num_host_blocks
    if "preemption" in options:
        mode = options["preemption"]
        assert engines[1].core.scheduler.num_preemptions[mode] > 0


def test_a_rank_fed_tokens_of_a_step_that_sampled_nothing_says_the_ranks_are_out_of_step():
    from candelabra.core.worker.parallel_runner import ParallelFailure, fed_tokens

    assert fed_tokens(None, None, None) is None
    with pytest.raises(ParallelFailure, match="sampled nothing on this rank"):
        fed_tokens(None, (np.array([0], np.int32), np.array([0], np.int32)), None)
