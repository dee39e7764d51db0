"""The communicator: how the processes of one tensor-parallel model exchange tensors.

One process runs per device, each holding a shard of every weight (see `candelabra.core.models.sharding`).
A backend hands out a `Communicator` from `Backend.communicator(...)`, built on an existing distributed
engine (torch.distributed: NCCL on CUDA, Gloo on a CPU), never on a transport of its own.

Every call is collective: each rank of the group makes the same calls in the same order, with
tensors of the same shape and dtype, or the group waits until its timeout and fails.
"""

from __future__ import annotations

from typing import Any

from candelabra.core.contract.ops import Tensor


class Communicator:
    """This process's membership in a group of `world_size` processes, as rank `rank` (0 to
    world_size - 1). Tensors are the backend's own, on its device."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """The elementwise sum of every rank's `tensor` (same shape and dtype on all ranks), on every
        rank. May sum into `tensor` itself: the caller uses the returned tensor and not `tensor`
        afterwards. In float16 and bfloat16 the sum is as precise as the backend's collective makes
        it (at two ranks: the exact sum, rounded once)."""
        raise NotImplementedError(f"{type(self).__name__} must implement all_reduce")

    def all_gather(self, tensor: Tensor, dim: int = -1) -> Tensor:
        """Every rank's `tensor` (same shape and dtype on all ranks) concatenated along `dim` in rank
        order, on every rank: rank 0's first. `tensor` is left unchanged."""
        raise NotImplementedError(f"{type(self).__name__} must implement all_gather")

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """The picklable object rank `src` passed, on every rank. Every rank calls it; the others
        pass None (what they pass is ignored)."""
        raise NotImplementedError(f"{type(self).__name__} must implement broadcast_object")

    def barrier(self) -> None:
        """Return once every rank has called barrier."""
        raise NotImplementedError(f"{type(self).__name__} must implement barrier")

    def close(self) -> None:
        """Leave the group and release what joining it took. No call may follow."""
        raise NotImplementedError(f"{type(self).__name__} must implement close")
