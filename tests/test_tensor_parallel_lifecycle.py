"""An offline tensor-parallel LLM's ranks over their life: closing gives back what rank 0 took, every
rank gives its cached memory back when rank 0 does, and a rank that dies while the ranks join fails
the LLM at once. Two ranks on the torch backend (rank 1 a process of its own), as a server runs them."""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
import torch
from tqdm import tqdm

from candelabra.backends.cpu import CpuBackend
from candelabra.core.loading.model import load_model
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.core.worker.parallel_runner import COLLECTIVE_TIMEOUT_SECONDS, ParallelFailure, ParallelModelRunner
from candelabra.core.worker.rank_process import serve_orders
from candelabra.core.worker.topology import Topology
from support import BroadcastOnlyRank, free_port


@dataclass(frozen=True)
class ThreadState:
    """What rank 0's backend may change on the thread that builds the LLM, and the threads and child
    processes it may start."""

    cores: frozenset[int]
    torch_threads: int
    threads: frozenset[threading.Thread]
    children: frozenset[int]

    @classmethod
    def now(cls) -> ThreadState:
        return cls(frozenset(os.sched_getaffinity(0)), torch.get_num_threads(), frozenset(threading.enumerate()),
                   frozenset(child.pid for child in psutil.Process().children()))


def two_ranks(tiny_llm, **options):
    return tiny_llm(1, backend="torch", dtype="float32", topology=Topology((0, 1), master_port=free_port()), **options)


@pytest.fixture
def no_tqdm_monitor(monkeypatch):
    """tqdm's monitor thread, which its first progress bar starts, is tqdm's, shared by every bar: not started here."""
    monkeypatch.setattr(tqdm, "monitor_interval", 0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="reads the thread's CPU affinity (Linux)")
def test_closing_gives_back_the_cores_and_threads_rank_0_took_and_leaves_no_thread_or_rank(tiny_llm,
                                                                                           no_tqdm_monitor):
    before = ThreadState.now()
    llm = two_ranks(tiny_llm)
    try:
        llm.workers.watch(lambda why: None)  # as a server watches its ranks
        taken = ThreadState.now()
        if len(before.cores) > 1:
            assert taken.cores < before.cores, "rank 0 runs on its share of the cores"
        three = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        assert len(llm.generate("w1 w2 w3", three, progress=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.close()
    assert ThreadState.now() == before
    llm.close()  # a second close changes nothing
    assert ThreadState.now() == before


def test_every_rank_gives_its_cached_memory_back_when_rank_0_does(tmp_path):
    from candelabra.conformance.engine_cases import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, seed=1)
    line, released = queue.Queue(), []
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        models = [load_model(checkpoint, CpuBackend(), "float32", communicator=BroadcastOnlyRank(rank, line))
                  for rank in (0, 1)]
    for rank, model in enumerate(models):
        model.backend.release_cached_memory = lambda rank=rank: released.append(rank)
    rank_1 = threading.Thread(target=serve_orders, args=(models[1], BroadcastOnlyRank(1, line)))
    rank_1.start()
    runner = ParallelModelRunner(models[0], BroadcastOnlyRank(0, line), num_blocks=4, block_size=16,
                                 kv_cache_dtype="float32")
    runner.release_cached_memory()
    runner.stop()
    rank_1.join(timeout=30)
    assert not rank_1.is_alive() and sorted(released) == [0, 1]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="reads the thread's CPU affinity (Linux)")
def test_a_rank_that_dies_while_the_ranks_join_fails_the_llm_at_once_with_its_exit_and_last_words(
        tiny_llm, no_tqdm_monitor, monkeypatch, tmp_path):
    before = ThreadState.now()
    monkeypatch.setenv("PYTHONHOME", str(tmp_path))  # rank 1's interpreter finds no standard library there
    started = time.monotonic()
    with pytest.raises(ParallelFailure) as failed:
        two_ranks(tiny_llm)
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT_SECONDS / 6, "reported when it died, not at the timeout"
    message = str(failed.value)
    assert "tensor-parallel rank 1" in message and "exited with code 1" in message, message
    assert "No module named 'encodings'" in message, message  # from its stderr
    assert ThreadState.now() == before
