"""Embeddings requests in the engine's steps: the scheduler keeps a slice of each step's token budget for
them, decodes keep their token a step while one runs, the vectors are those of pooling alone, and an
abort between two slices gives every borrowed block back."""

import numpy as np
import pytest

from candelabra.core.engine.pooling import PooledOutput, PoolingJob, embed
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.sequence import Sequence
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.scheduler import Scheduler


def _sequence(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(f"r{seq_id}", 0, prompt, SamplingParams(max_tokens=4), seq_id, np.random.default_rng(0))


def test_the_reserve_comes_after_running_sequences_and_before_new_prompts():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32, prefill_chunk_size=16)
    scheduler.add(_sequence(0, list(range(20))))
    first = scheduler.schedule(reserve=10)  # nothing runs yet: the reserve is taken, the prompt gets the rest
    assert first.reserved == 10 and [item.num_tokens for item in first.scheduled] == [16]
    scheduler.commit(first)
    scheduler.add(_sequence(1, list(range(30, 50))))
    second = scheduler.schedule(reserve=30)  # the running prompt's last 4 tokens first, then the reserve
    assert [item.num_tokens for item in second.scheduled] == [4]
    assert second.reserved == 28 and len(scheduler.waiting) == 1  # no budget was left for the new prompt


def _engine(tiny_llm, **options):
    llm = tiny_llm(options.pop("seed", 5), **options)
    return llm, llm.engine.core


def _inputs(rng, count, low=1, high=12, vocab=100):
    return [rng.integers(3, vocab, rng.integers(low, high)).tolist() for _ in range(count)]


def test_decodes_keep_a_token_a_step_while_a_large_request_is_pooled(tiny_llm):
    llm, core = _engine(tiny_llm, max_num_batched_tokens=48, prefill_chunk_size=24, max_num_seqs=4)
    rng = np.random.default_rng(7)
    inputs = _inputs(rng, 40) + [rng.integers(3, 100, 70).tolist()]  # one longer than a slice
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request(f"gen-{i}", rng.integers(3, 100, 5).tolist(), params)
    for _ in range(3):  # the prompts' steps: every request decodes from here on
        llm.engine.step()
    core.add_pooling("embd", PoolingJob(inputs, "mean"))
    pooled, slices = None, []
    while pooled is None:
        generated, ran = core.stats["generated_tokens"], core.stats["pooled_tokens"]
        outputs = core.step()
        assert core.stats["generated_tokens"] - generated == 3, "a decode lost its step to the pooling"
        slices.append(core.stats["pooled_tokens"] - ran)
        pooled = next((o for o in outputs if isinstance(o, PooledOutput)), None)
    assert max(slices) <= 24 and len(slices) > 10  # a prompt chunk's tokens a step at most
    alone = embed(core.runner, BlockManager(core.config.num_blocks, core.config.block_size), inputs, "mean")
    np.testing.assert_allclose(pooled.embeddings, alone, rtol=1e-5, atol=1e-6)
    assert pooled.num_tokens == sum(map(len, inputs))
    while core.has_unfinished_requests():
        core.step()
    assert core.blocks.num_free_blocks == core.config.num_blocks


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_slices_of_any_size_pool_as_one_forward_does(tiny_llm, pooling):
    llm, core = _engine(tiny_llm)
    rng = np.random.default_rng(11)
    inputs = _inputs(rng, 9, 1, 30)
    whole = embed(core.runner, core.blocks, inputs, pooling, max_batch_tokens=4096, chunk_tokens=4096)
    for budget, max_inputs, chunk in ((1, 1, 1), (7, 2, 5), (13, 64, 64)):
        job = PoolingJob(inputs, pooling)
        while not job.done:
            assert job.advance(core.runner, core.blocks, budget, max_inputs, chunk) <= budget
        job.release()
        np.testing.assert_allclose(job.result(), whole, rtol=1e-5, atol=1e-6, err_msg=f"slices of {budget}")
    assert core.blocks.num_free_blocks == core.config.num_blocks


def test_an_abort_between_slices_gives_every_block_back(tiny_llm):
    llm, core = _engine(tiny_llm, max_num_batched_tokens=32, prefill_chunk_size=16)
    rng = np.random.default_rng(3)
    core.add_pooling("embd", PoolingJob([rng.integers(3, 100, 150).tolist()] + _inputs(rng, 50), "last"))
    for _ in range(4):
        assert core.step() == []
    assert core.blocks.num_free_blocks < core.config.num_blocks  # the long input holds its blocks between slices
    ran = core.stats["pooled_tokens"]
    core.abort_request("embd")
    assert core.blocks.num_free_blocks == core.config.num_blocks and not core.has_unfinished_requests()
    assert core.step() == [] and core.stats["pooled_tokens"] == ran


def test_a_request_waits_for_blocks_that_others_hold(tiny_llm):
    llm, core = _engine(tiny_llm)
    size = core.config.block_size
    core.blocks.allocate(-999, [-1] * ((core.blocks.num_free_blocks - 2) * size))  # two blocks left free
    job = PoolingJob([list(range(3, 3 + 3 * size))], "mean")  # needs three
    core.add_pooling("embd", job)
    for _ in range(3):
        assert core.step() == [] and job.remaining_tokens == 3 * size
    core.blocks.free(-999)
    outputs = core.step()
    assert [type(o) for o in outputs] == [PooledOutput] and not core.has_unfinished_requests()
    assert core.blocks.num_free_blocks == core.config.num_blocks


def test_an_input_larger_than_the_cache_is_refused_when_added(tiny_llm):
    llm, core = _engine(tiny_llm)
    capacity = core.config.num_blocks * core.config.block_size
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        core.add_pooling("embd", PoolingJob([[5] * (capacity + 1)]))
    assert not core.pooling
