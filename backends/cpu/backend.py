"""The numpy reference backend: what CPU users run and what other backends are measured against."""

from __future__ import annotations

import os

import numpy as np
import psutil

from candelabra.backends.cpu.attention import prepare_step
from candelabra.backends.cpu.ops import NumpyOps
from candelabra.core.contract.attention_layout import GatheredStep
from candelabra.core.contract.backend import Backend, Probe
from candelabra.core.contract.device import Device
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata
from candelabra.core.contract.weights import QuantizedTensor


class CpuBackend(Backend):
    name = "cpu"
    dtypes = ("float32",)

    def __init__(self, device: Device | None = None) -> None:
        super().__init__(device)
        self.ops = NumpyOps()

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, detail=f"cpu ({os.cpu_count()} cores, numpy {np.__version__})", priority=10)

    def to_device(self, array, dtype=None):
        array = np.asarray(array)
        if array.dtype.kind == "f":
            return np.array(array, dtype=np.float32 if dtype is None else self.check_dtype(dtype), copy=True)
        if array.dtype.kind in "iub":
            return np.array(array, copy=True)
        raise TypeError(f"cannot move an array of dtype {array.dtype} to the cpu backend")

    def to_host(self, tensor):
        return np.array(tensor, copy=True)

    def dtype_of(self, tensor):
        return str(tensor.dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=self.check_dtype(dtype))

    def upload_weight(self, name, role, weight, dtype):
        if isinstance(weight, QuantizedTensor):
            return super().upload_weight(name, role, weight, dtype)
        # The host array is handed over for good, so it is kept as it is: no copy, and a tied LM
        # head, handed over as the embedding's own array, is one array for both.
        return np.asarray(weight, dtype=self.check_dtype(dtype))

    def free_memory(self) -> int:
        return int(psutil.virtual_memory().available)

    def kv_cache_fraction(self) -> float:
        """The host's RAM is shared with every other program."""
        return 0.25

    def kv_cache_committed_on_write(self) -> bool:
        return True  # np.zeros maps a large array's pages only when written

    def shares_host_memory(self) -> bool:
        return True  # numpy's arrays are the host's

    def synchronize(self) -> None:
        """numpy computes eagerly: by the time a call returns its work is done."""

    @classmethod
    def kv_cache_dtypes(cls, compute_dtype):
        """float32, or int8 rows that write_kv quantizes and attention reads back to float32."""
        return (compute_dtype, "int8")

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        return [KVCache(np.zeros(spec.block_shape, spec.storage_dtype), np.zeros(spec.value_block_shape,
                                                                                   spec.storage_dtype))
                for _ in range(spec.num_layers)]

    def allocate_swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        return self.allocate_kv_cache(spec)

    def copy_blocks(self, caches, mapping):
        return _copy_between(caches, caches, mapping)

    def swap_out(self, caches, swap, mapping):
        return _copy_between(caches, swap, mapping)

    def swap_in(self, caches, swap, mapping):
        return _copy_between(swap, caches, mapping)

    def prepare_step(self, meta: StepMetadata) -> GatheredStep:
        return prepare_step(meta)

    def prepare_sampling(self, meta: SamplingMetadata) -> SamplingMetadata:
        return meta


def _copy_between(source: list[KVCache], target: list[KVCache], mapping: np.ndarray) -> list[KVCache]:
    mapping = np.asarray(mapping, dtype=np.int64).reshape(-1, 2)
    src, dst = mapping[:, 0], mapping[:, 1]
    for from_layer, to_layer in zip(source, target):
        to_layer.key[dst] = from_layer.key[src]
        to_layer.value[dst] = from_layer.value[src]
    return target
