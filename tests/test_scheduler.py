"""Scheduler corner cases, with the block manager but no model: steps are simulated by marking
the scheduled tokens computed and appending one sampled token per finished prefill or decode."""

import numpy as np
import pytest

from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.sequence import Sequence, SequenceStatus
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.scheduler import Scheduler

BLOCK = 4


def make(scheduler, request_id, prompt_len, arrival=0):
    seq = Sequence(request_id, 0, list(range(10, 10 + prompt_len)), SamplingParams(), arrival,
                   np.random.default_rng(0))
    scheduler.add(seq)
    return seq


def step(scheduler):
    """Schedule, then do what the engine would after running the model."""
    out = scheduler.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        scheduler.blocks.mark_computed(item.seq.seq_id, item.seq.num_computed_tokens)
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.append_output(7)
    return out


def scheduler_with(num_blocks=16, host_blocks=0, max_num_seqs=8, budget=64, chunk=0, preemption="auto"):
    blocks = BlockManager(num_blocks, BLOCK, host_blocks)
    return Scheduler(blocks, max_num_seqs, budget, chunk, preemption)


def test_token_budget_and_chunked_prefill_mix_with_decodes():
    s = scheduler_with(budget=8, chunk=5)
    first = make(s, "a", 3)
    step(s)  # a's prompt
    second = make(s, "b", 12, arrival=1)
    out = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("a", 1), ("b", 5)]
    out = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("a", 1), ("b", 5)]
    out = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("a", 1), ("b", 2)]
    assert second.output_token_ids == (7,) and first.num_output_tokens == 4


def test_unchunked_prompt_waits_for_a_step_with_room_for_all_of_it():
    s = scheduler_with(budget=10, chunk=0)
    make(s, "a", 6)
    make(s, "b", 6, arrival=1)
    out = step(s)
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert s.num_waiting == 1


def test_max_num_seqs_limits_the_running_set():
    s = scheduler_with(max_num_seqs=2)
    for i in range(4):
        make(s, f"r{i}", 3, arrival=i)
    step(s)
    assert s.num_running == 2 and s.num_waiting == 2


def test_exhausted_blocks_keep_requests_waiting_first_come_first_served():
    s = scheduler_with(num_blocks=4)
    make(s, "big", 12)  # 3 blocks
    make(s, "next", 8, arrival=1)  # 2 blocks: must wait
    make(s, "small", 2, arrival=2)  # would fit, but must not overtake "next"
    out = step(s)
    assert [i.seq.request_id for i in out.scheduled] == ["big"]
    assert [seq.request_id for seq in s.waiting] == ["next", "small"]


def test_abort_mid_prefill_frees_everything():
    s = scheduler_with(budget=4, chunk=4)
    seq = make(s, "a", 14)
    step(s)
    assert seq.num_computed_tokens == 4 and s.blocks.num_free_blocks < 16
    s.abort("a")
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert s.blocks.num_free_blocks == 16 and not s.has_unfinished()


def test_preemption_picks_the_newest_request_and_recomputes_without_host_space():
    s = scheduler_with(num_blocks=4)
    old, new = make(s, "old", 4), make(s, "new", 4, arrival=1)
    step(s)
    step(s)  # both decode into their second block: all 4 blocks used
    for _ in range(3):
        step(s)
    out = step(s)  # old needs a third block: new is preempted
    assert new in out.preempted and old not in out.preempted
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert s.num_preemptions == {"swap": 0, "recompute": 1}


def test_swap_preemption_and_swap_in_when_room_returns():
    s = scheduler_with(num_blocks=4, host_blocks=8)
    old, new = make(s, "old", 4), make(s, "new", 4, arrival=1)
    for _ in range(6):
        out = step(s)
        if out.preempted:
            break
    assert new.status is SequenceStatus.SWAPPED and out.swap_out
    s.finish(old, "stop")
    out = step(s)
    assert out.swap_in and new.status is SequenceStatus.RUNNING


def test_full_host_space_falls_back_to_recompute_unless_swap_is_required():
    for mode, expected in (("auto", SequenceStatus.WAITING), ("swap", None)):
        s = scheduler_with(num_blocks=4, host_blocks=1, preemption=mode)
        make(s, "old", 4)
        new = make(s, "new", 4, arrival=1)
        if expected is None:
            with pytest.raises(RuntimeError, match="host swap space is full"):
                for _ in range(6):
                    step(s)
        else:
            for _ in range(6):
                step(s)
            assert new.status is expected or new.status is SequenceStatus.RUNNING
            assert s.num_preemptions["recompute"] >= 1


def test_unknown_preemption_mode_is_rejected():
    with pytest.raises(ValueError, match="preemption must be one of auto, swap, recompute"):
        scheduler_with(preemption="drop")


def test_a_sequence_keeps_one_token_list_that_outputs_extend_and_forks_copy():
    seq = Sequence("r", 0, [5, 6, 7], SamplingParams(), 0, np.random.default_rng(0))
    tokens = seq.token_ids
    seq.append_output(8)
    seq.append_output(9)
    assert seq.token_ids is tokens and tokens == [5, 6, 7, 8, 9]
    assert seq.prompt_token_ids == (5, 6, 7) and seq.output_token_ids == (8, 9)
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (5, 3, 2)
    child = seq.fork(1)
    child.append_output(12)
    assert child.token_ids == [5, 6, 7, 8, 9, 12] and seq.token_ids == [5, 6, 7, 8, 9]
    assert child.prompt_token_ids == (5, 6, 7) and child.output_token_ids == (8, 9, 12)


def test_a_sequences_prompt_and_output_cannot_be_changed_behind_its_back():
    seq = Sequence("r", 0, [5, 6, 7], SamplingParams(), 0, np.random.default_rng(0))
    with pytest.raises(AttributeError):
        seq.output_token_ids.append(8)
    with pytest.raises(AttributeError):
        seq.output_token_ids = [8]
