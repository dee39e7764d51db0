"""Rank 0's side of tensor parallelism: its model runner hands every step, and the few other calls
every rank must make together (the KV cache's size, warm-up, swap space, giving cached memory back
when idle, stopping), to the other ranks through the backend's communicator before running it
itself. The other ranks' side is `rank_process`; starting and watching them is `worker_processes`.

A step scheduled ahead takes its pending tokens from the step before's samples on the device. Every
rank samples the same logits, but rank 0's tokens are the ones its scheduler goes on with, so at such
a step every rank gathers every rank's sampled ids and feeds rank 0's (`rank_zero_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.executor import TokenFeed
from candelabra.core.worker.failure import EngineFailure
from candelabra.core.worker.model_runner import ModelRunner, StepOrder

# Collectives that wait this long for a rank fail: a rank that hangs becomes an error, not a hang.
COLLECTIVE_TIMEOUT_SECONDS = 120.0


class ParallelFailure(EngineFailure):
    """A rank is gone or a collective failed: the ranks are out of step, and the engine cannot go on."""


@dataclass(frozen=True)
class CacheOrder:
    """The KV cache every rank allocates: rank 0 sizes it from its own free memory."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: DType


class ParallelModelRunner(ModelRunner):
    """Rank 0's model runner: every call that runs the model, or that every rank must make, is
    broadcast to the other ranks first."""

    def __init__(self, model, communicator, num_blocks: int, block_size: int, kv_cache_dtype: DType,
                 find_dead_rank: Callable[[], str | None] = lambda: None) -> None:
        """`find_dead_rank` names a rank that is gone, if any: a failed collective is reported as that."""
        self.communicator, self.find_dead_rank = communicator, find_dead_rank
        self._tell("cache", CacheOrder(num_blocks, block_size, kv_cache_dtype))
        super().__init__(model, num_blocks, block_size, kv_cache_dtype)

    def warm_up(self, max_num_seqs: int) -> None:
        self._tell("warm_up", max_num_seqs)
        super().warm_up(max_num_seqs)

    def allocate_swap_space(self, num_host_blocks: int) -> None:
        self._tell("swap_space", num_host_blocks)
        super().allocate_swap_space(num_host_blocks)

    def release_cached_memory(self) -> None:
        self._tell("release_cached_memory", None)
        super().release_cached_memory()

    def run(self, order: StepOrder, feed: TokenFeed | None = None):
        self._tell("step", (order, None if feed is None else (feed.positions, feed.rows)))
        try:
            if feed is not None:
                feed = replace(feed, source=rank_zero_tokens(self.communicator, feed.source))
            return super().run(order, feed)
        except Exception as exc:
            raise self._failure("a tensor-parallel step failed", exc) from exc

    def stop(self) -> None:
        """Tell the other ranks to exit, and leave the group."""
        try:
            self._tell("stop", None)
        finally:
            self.communicator.close()

    def _tell(self, order: str, value) -> None:
        try:
            self.communicator.broadcast_object((order, value), src=0)
        except Exception as exc:
            raise self._failure("cannot reach the other tensor-parallel ranks", exc) from exc

    def _failure(self, context: str, exc: Exception) -> ParallelFailure:
        dead = self.find_dead_rank()
        return ParallelFailure(f"{dead}, so the ranks are out of step" if dead else f"{context}: {exc}")


def rank_zero_tokens(communicator, sampled_ids: Any) -> Any:
    """Rank 0's sampled token ids (int32 [R] on the device), on every rank: each passes its own."""
    return communicator.all_gather(sampled_ids, dim=0)[: sampled_ids.shape[0]]


def fed_tokens(communicator, feed_rows: tuple | None, previous: Any) -> TokenFeed | None:
    """A rank other than 0: the feed of a step rank 0 ordered with `feed_rows` (positions, rows or None),
    from `previous`, this rank's result of the step before."""
    if feed_rows is None:
        return None
    if previous is None or previous.sampled is None:
        raise ParallelFailure("rank 0 fed a step tokens of a step before that sampled nothing on this rank")
    positions, rows = feed_rows
    return TokenFeed(rank_zero_tokens(communicator, previous.sampled.token_ids), positions, rows)
