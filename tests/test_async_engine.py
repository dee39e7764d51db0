"""Streaming through the async engine: concurrent consumers, deltas, and aborts on disconnect."""

import asyncio
import time

import pytest

from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.engine.async_engine import AsyncEngine
from candelabra.core.engine.sampling_params import SamplingParams
from candelabra.core.llm import LLM

PROMPTS = [[5, 9, 23, 42], [7, 11, 13], [40, 41, 42, 43, 44, 45]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder, seed=9)
    return LLM(folder, backend="cpu", kvcache_mem_gpu=4, kvcache_mem_cpu=0)


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
