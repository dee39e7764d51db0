"""Streaming through the async engine: concurrent consumers, deltas, and aborts on disconnect."""

import asyncio
import threading
import time

import pytest

from candelabra.core.engine.async_engine import AsyncEngine
from candelabra.core.engine.output_processor import Prefix
from candelabra.core.requests.sampling_params import SamplingParams

PROMPTS = [[5, 9, 23, 42], [7, 11, 13], [40, 41, 42, 43, 44, 45]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(seed=9)


def test_concurrent_streams_match_offline_generation(llm):
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, progress=False)]
    engine = AsyncEngine(llm.engine)

    async def consume(i):
        text, tokens, last = "", [], None
        async for output in engine.generate(f"stream-{i}", PROMPTS[i], GREEDY):
            text += output.outputs[0].delta_text
            tokens += output.outputs[0].delta_token_ids
            last = output
        return text, tokens, last

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (text, tokens, last), want in zip(results, expected):
        assert tokens == want.token_ids and text == want.text
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_streamed_outputs_keep_their_tokens_as_they_were_and_the_finished_one_holds_lists(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = AsyncEngine(llm.engine)

    async def consume():
        seen = []
        async for output in engine.generate("snapshots", PROMPTS[0], params):
            sample = output.outputs[0]
            seen.append((sample, list(sample.token_ids), list(sample.logprobs)))
        return seen

    try:
        seen = asyncio.run(consume())
    finally:
        engine.shutdown()
    assert len(seen) > 2
    for sample, tokens_then, logprobs_then in seen:  # read again once the request has finished
        assert sample.token_ids == tokens_then and list(sample.logprobs) == logprobs_then
        assert len(sample.logprobs) == len(sample.token_ids)
    final = seen[-1][0]
    assert type(final.token_ids) is list and type(final.logprobs) is list and len(final.token_ids) == 12
    assert isinstance(seen[0][0].token_ids, Prefix)


def test_a_prefix_reads_as_the_list_it_was_when_taken():
    items = [3, 1, 4, 1, 5]
    prefix = Prefix(items, 4)
    items += [9, 2]
    assert len(prefix) == 4 and list(prefix) == [3, 1, 4, 1] and prefix == [3, 1, 4, 1] == prefix
    assert prefix != [3, 1, 4, 1, 5] and prefix != (3, 1, 4) and prefix == Prefix([3, 1, 4, 1, 7], 4)
    assert prefix[-1] == 1 and prefix[0] == 3 and prefix[1:] == [1, 4, 1] and prefix[::-2] == [1, 1]
    assert prefix[2:99] == [4, 1] and repr(prefix) == "[3, 1, 4, 1]" and prefix.count(1) == 2 and 5 not in prefix
    with pytest.raises(IndexError):
        prefix[4]
    with pytest.raises(IndexError):
        prefix[-5]
    with pytest.raises(TypeError):
        hash(prefix)


def test_a_consumer_that_stops_early_aborts_its_request(llm):
    engine = AsyncEngine(llm.engine)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate("walks-away", PROMPTS[0] * 10, long)
        async for _ in stream:
            break  # the client disconnects after the first chunk
        await stream.aclose()

    try:
        asyncio.run(main())
        blocks = llm.engine.blocks
        deadline = time.monotonic() + 10  # the engine thread takes the abort after its current step
        while ("walks-away" in llm.engine.requests or blocks.num_free_blocks != blocks.num_blocks) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "walks-away" not in llm.engine.requests
        assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        engine.shutdown()


def test_a_bad_request_fails_its_caller_only(llm):
    engine = AsyncEngine(llm.engine)

    async def main():
        with pytest.raises(ValueError, match="the prompt is empty"):
            async for _ in engine.generate("empty", [], GREEDY):
                pass
        return [o async for o in engine.generate("fine", PROMPTS[1], GREEDY)][-1]

    try:
        assert asyncio.run(main()).finished
    finally:
        engine.shutdown()


def test_an_engine_given_as_a_builder_is_built_and_stepped_on_the_engine_thread(tiny_llm):
    threads = {}
    llms = []

    def build():
        threads["built"] = threading.get_ident()
        llms.append(tiny_llm(seed=9))
        step = llms[0].engine.core.step

        def recorded_step():
            threads.setdefault("stepped", threading.get_ident())
            return step()

        llms[0].engine.core.step = recorded_step
        return llms[0].engine

    engine = AsyncEngine(build)

    async def generate():
        return [output async for output in engine.generate("built", PROMPTS[0], GREEDY)]

    try:
        outputs = asyncio.run(generate())
    finally:
        engine.shutdown()
    expected = llms[0].generate([PROMPTS[0]], GREEDY, progress=False)[0].outputs[0].token_ids
    assert sum((o.outputs[0].delta_token_ids for o in outputs), []) == expected
    assert threads["built"] == threads["stepped"] == engine._thread.ident != threading.get_ident()


def test_a_builder_that_fails_raises_its_error_in_the_constructor():
    def build():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        AsyncEngine(build)


def test_an_idle_engine_gives_its_backends_cached_memory_back_once(llm, monkeypatch):
    from candelabra.core.engine import async_engine

    monkeypatch.setattr(async_engine, "RELEASE_AFTER_IDLE_SECONDS", 0.2)
    released = []
    monkeypatch.setattr(llm.engine.backend, "release_cached_memory", lambda: released.append(time.monotonic()))
    engine = AsyncEngine(llm.engine)

    async def generate():
        async for output in engine.generate("idle", PROMPTS[0], GREEDY):
            last = output
        return time.monotonic(), last

    try:
        time.sleep(0.5)
        assert released == []  # nothing ran yet: nothing to give back
        finished, last = asyncio.run(generate())
        assert last.finished
        deadline = time.monotonic() + 30
        while not released and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and no second release while it stays idle
    finally:
        engine.shutdown()
    assert len(released) == 1 and released[0] - finished >= 0.15
