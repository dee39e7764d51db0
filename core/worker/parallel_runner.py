"""Rank 0's side of tensor parallelism: its model runner hands every step, and the few other calls
every rank must make together (the KV cache's size, warm-up, swap space, giving cached memory back
when idle, stopping), to the other ranks through the backend's communicator before running it
itself. The other ranks' side is `rank_process`; starting and watching them is `worker_processes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from candelabra.core.contract.dtypes import DType
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

    schedules_ahead = False  # the other ranks would need the pending tokens: steps wait for them

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

    def run(self, order: StepOrder, feed=None):
        if feed is not None:
            raise RuntimeError("a tensor-parallel step cannot take its tokens from the previous step's on the "
                               "device: every rank would need them")
        self._tell("step", order)
        try:
            return super().run(order)
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
