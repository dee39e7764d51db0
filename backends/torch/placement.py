"""Where a torch backend's tensors live, and what follows from it: the host's RAM (the CPU itself, or a
device backend standing in on the CPU) or a device with memory of its own. `TorchBackend` chooses one
when it starts and asks it everything that differs: threads and freed memory, free memory and the KV
cache's share of it, how the caches and the swap space are allocated, how results come back to the
host, whether experts kept in host memory are apart from the device's and pinned, whether a quantized
weight is kept in a CPU kernel's form, and which collective library sums the tensors."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from candelabra.backends.torch.cpu.features import has_native_bfloat16, take_share_of_cores, usable_cores
from candelabra.backends.torch.dtypes import torch_dtype
from candelabra.backends.torch.host_memory import give_freed_memory_back, keep_freed_memory_for_reuse
from candelabra.backends.torch.numa_binding import bind_to_node, forget_node_memory
from candelabra.core.contract.device import Device
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.weights import QuantizedTensor, WeightRole

log = logging.getLogger("candelabra")


class HostPlacement:
    """Tensors in the host's RAM, shared with everything else on the machine."""

    # A quarter of the available RAM for the KV cache, where a device of its own gives half its memory.
    kv_cache_fraction = 0.25
    # The caches are allocated untouched (see `kv_cache`): a block costs RAM once written.
    kv_cache_committed_on_write = True
    runs_apart_from_host = False  # torch's CPU ops return computed
    # 512 on a CPU: 128 requests of the default model, 64 at a time, 64 words in and 64 tokens out,
    # peaked 165 MiB lower than at 2048, at 198 against 181 tokens/s.
    max_num_batched_tokens = 512
    # Gloo sums CPU tensors, whatever library the device backend would use on its device.
    distributed_library = "gloo"
    # Experts "in host memory" would be where they are already.
    shares_host_memory = True
    pins_host_memory = False

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device
        self._before: _ThreadSettings | None = None

    def configure(self, device: Device, default_dtype: str) -> None:
        """Use every core this process may run on (its share of them, as one of several ranks), keep
        freed memory for reuse, and say which dtype is the default and why."""
        from candelabra.backends.torch.packed_int8 import limit_primitive_cache

        self._before = _ThreadSettings.of_this_thread()
        self._bound = device.numa_node is not None and bind_to_node(device)
        if device.numa_node is None and device.world_size > 1:
            take_share_of_cores(device.index, device.world_size)
        cores = usable_cores()
        if torch.get_num_threads() != cores:
            torch.set_num_threads(cores)
        keep_freed_memory_for_reuse()
        limit_primitive_cache()
        log.info("torch backend on cpu: %d threads, default dtype %s (%s)", cores, default_dtype,
                 "the CPU has bfloat16 in hardware" if has_native_bfloat16() else "no bfloat16 in hardware")

    def release_cached_memory(self) -> None:
        give_freed_memory_back()

    def restore_thread_settings(self) -> None:
        before, self._before = self._before, None
        if before is not None:
            before.restore()
        if getattr(self, "_bound", False) and before is not None and before.thread is threading.current_thread():
            forget_node_memory()

    def free_memory(self) -> int:
        return int(psutil.virtual_memory().available)

    def synchronize(self) -> None:
        pass

    def fetch(self, to_host, tensors) -> tuple[np.ndarray, ...]:
        return tuple(to_host(tensor) for tensor in tensors)

    def start_fetch(self, to_host, tensors):
        return lambda: self.fetch(to_host, tensors)  # computed already: nothing to start

    def kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        return [KVCache(_untouched_zeros(spec, spec.block_shape), _untouched_zeros(spec, spec.value_block_shape))
                for _ in range(spec.num_layers)]

    def swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        return self.kv_cache(spec)

    def keep_quantized(self, weight: QuantizedTensor, dtype: str, role: WeightRole, kernel_selector):
        """`weight` in the form the kernel table names for this CPU (an embedding table: one whose rows
        can be read back), or None where no form beats dequantizing."""
        from candelabra.backends.torch.quantized import keep_quantized

        if role is WeightRole.EMBEDDING:
            return keep_quantized(weight, torch_dtype(dtype), readable=True)
        return keep_quantized(weight, torch_dtype(dtype), kernel_selector(dtype))


@dataclass(frozen=True)
class _ThreadSettings:
    """A thread's cores (None where the OS has no affinity) and torch thread count, to put back."""

    thread: threading.Thread
    cores: frozenset[int] | None
    torch_threads: int

    @classmethod
    def of_this_thread(cls) -> _ThreadSettings:
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(threading.current_thread(), cores, torch.get_num_threads())

    def restore(self) -> None:
        """The cores from any thread, while that thread runs; the thread count only on it, whose
        count it is (a server's engine thread has ended before the server closes its model)."""
        if not self.thread.is_alive():
            return
        if self.cores is not None:
            os.sched_setaffinity(self.thread.native_id, self.cores)
        if self.thread is threading.current_thread():
            torch.set_num_threads(self.torch_threads)


class DevicePlacement:
    """Tensors in a device's own memory, the host reached by copies."""

    kv_cache_fraction = 0.5
    kv_cache_committed_on_write = False
    runs_apart_from_host = True  # a device's stream computes what the host queued
    max_num_batched_tokens = None  # the backend contract's default
    shares_host_memory = False

    def __init__(self, torch_device: torch.device, distributed_library: str) -> None:
        self.torch_device = torch_device
        self.distributed_library = distributed_library
        # Page-locked host memory, which a device copies from asynchronously; torch's CPU device standing
        # in for one (in tests) has nothing to pin it for.
        self.pins_host_memory = torch_device.type != "cpu"

    def configure(self, device: Device, default_dtype: str) -> None:
        bind_to_node(device)  # the host threads that feed the device, near it; the backend configures the device

    def release_cached_memory(self) -> None:
        pass

    def restore_thread_settings(self) -> None:
        pass

    def free_memory(self) -> int:
        free, _total = getattr(torch, self.torch_device.type).mem_get_info(self.torch_device)
        return int(free)

    def synchronize(self) -> None:
        getattr(torch, self.torch_device.type).synchronize(self.torch_device)

    def fetch(self, to_host, tensors) -> tuple[np.ndarray, ...]:
        """The tensors' bytes packed into one buffer, copied to the host once."""
        return self.start_fetch(to_host, tensors)()

    def start_fetch(self, to_host, tensors):
        """The packed copy queued now, into page-locked memory, behind the work already queued; the
        function returned waits for that copy alone (not for work queued after it) and unpacks it."""
        flat = [t.detach().contiguous().reshape(-1) for t in tensors]
        packed = torch.cat([t.view(torch.uint8) for t in flat])
        done = self._event() if self.pins_host_memory else None
        if done is None:
            host = packed.to("cpu")
        else:
            host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done.record()

        def finish() -> tuple[np.ndarray, ...]:
            if done is not None:
                done.synchronize()
            out, offset = [], 0
            for tensor, part in zip(tensors, flat):
                size = part.numel() * part.element_size()
                out.append(to_host(host[offset:offset + size].view(part.dtype).reshape(tensor.shape)))
                offset += size
            return tuple(out)

        return finish

    def _event(self):
        """An event on the device's stream, or None where its torch build has none (a copy then waits)."""
        try:
            return torch.Event(device=self.torch_device)
        except (RuntimeError, ValueError, TypeError):
            return None

    def kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        dtype = torch_dtype(spec.storage_dtype)
        return [KVCache(torch.zeros(spec.block_shape, dtype=dtype, device=self.torch_device),
                        torch.zeros(spec.value_block_shape, dtype=dtype, device=self.torch_device))
                for _ in range(spec.num_layers)]

    def swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        # Pinned host memory copies to and from a device asynchronously.
        dtype = torch_dtype(spec.storage_dtype)
        return [KVCache(torch.zeros(spec.block_shape, dtype=dtype, pin_memory=True),
                        torch.zeros(spec.value_block_shape, dtype=dtype, pin_memory=True))
                for _ in range(spec.num_layers)]

    def keep_quantized(self, weight: QuantizedTensor, dtype: str, role: WeightRole, kernel_selector):
        return None  # the CPU's quantized kernels do not run here: dequantized


def _untouched_zeros(spec: KVCacheSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros in host memory whose pages the OS maps only when first written (numpy's calloc), so a KV
    cache sized for the worst case occupies RAM only as far as sequences fill it. torch.zeros writes
    every page up front."""
    dtype = torch_dtype(spec.storage_dtype)
    raw = np.zeros(shape, dtype=np.dtype(f"u{torch.empty((), dtype=dtype).element_size()}"))
    return torch.from_numpy(raw).view(dtype)
