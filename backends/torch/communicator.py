"""The torch family's communicator: torch.distributed's collectives on the backend's device.

The process-group backend is the backend class's `distributed_backend`: Gloo for CPU tensors, NCCL
on CUDA, a vendor's collective library on its device. Gloo sums float16 and bfloat16 correctly on a
CPU (checked with torch 2.13: at two ranks every element is the exact sum rounded once, the same
as summing in float32 and casting back), so tensors are reduced in their own dtype.

The ranks meet at a TCP store that rank 0 serves: each says there that it has come, then waits until
all have, calling the caller's `while_waiting` between looks, before the process group is made over
the same store. torch's own rendezvous would wait out the whole timeout for a rank that has died.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from candelabra.core.contract.communicator import Communicator

# How often a rank waiting for the others looks at the store and calls `while_waiting`.
LOOK_EVERY_SECONDS = 0.1


class TorchDistributedCommunicator(Communicator):
    """Rank `rank` of `world_size` in torch.distributed's default process group, which this joins
    over TCP at `master_addr`:`master_port` (rank 0 listens there)."""

    def __init__(self, process_group_backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 60.0, device: torch.device | None = None,
                 while_waiting: Callable[[], None] | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group; a process serves "
                               "one rank of one model: close the other communicator first")
        store = _meet(master_addr, master_port, rank, world_size, timeout_s, while_waiting or (lambda: None))
        dist.init_process_group(backend=process_group_backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")

    def all_reduce(self, tensor):
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor, dim=-1):
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj, src=0):
        holder = [obj if self.rank == src else None]
        # NCCL moves the pickled bytes through the device; Gloo through the host.
        device = self.device if self.device.type != "cpu" else None
        dist.broadcast_object_list(holder, src=src, device=device)
        return holder[0]

    def barrier(self):
        dist.barrier()

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def _meet(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float,
          while_waiting: Callable[[], None]):
    """The TCP store at `master_addr`:`master_port` (rank 0 serves it) once every rank has said there
    that it came; TimeoutError naming the ranks still missing after `timeout_s` seconds."""
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    arrivals = [f"candelabra/rank-{other}-came" for other in range(world_size)]
    try:
        store.set(arrivals[rank], "1")
        deadline = time.monotonic() + timeout_s
        while not store.check(arrivals):
            while_waiting()
            if time.monotonic() > deadline:
                missing = [str(other) for other, key in enumerate(arrivals) if not store.check([key])]
                raise TimeoutError(f"tensor-parallel ranks {', '.join(missing)} of {world_size} did not join "
                                   f"within {timeout_s:g} s")
            time.sleep(LOOK_EVERY_SECONDS)
    except BaseException:
        del store  # rank 0 stops listening now, not once the error's traceback is forgotten
        raise
    return store
