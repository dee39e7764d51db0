"""The MLX backend. MLX arrays are lazy and immutable: every call that changes a cache returns
it, and nothing is computed until `evaluate` (once per model step) or a copy to the host."""

from __future__ import annotations

import numpy as np
import psutil

from candelabra.core.contract.attention_layout import gather_groups
from candelabra.core.contract.backend import Backend, Probe
from candelabra.core.contract.device import Device
from candelabra.core.contract.executor import StepExecutor, StepInputs, TokenFeed
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata
from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, WeightRole

try:
    import mlx.core as mx
except Exception as exc:  # noqa: BLE001 - probe() reports why MLX cannot be used
    mx = None
    _MLX_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


class MetalBackend(Backend):
    name = "metal"
    dtypes = ("float32", "float16", "bfloat16")
    # GPTQ's and AWQ's int4 groups stay MLX quantized arrays (quantized.py); GGUF formats are dequantized.
    quantized_formats = frozenset(INT4_GROUP_FORMATS)

    def __init__(self, device: Device | None = None) -> None:
        if mx is None:
            raise RuntimeError(self.probe().reason)
        super().__init__(device)
        from candelabra.backends.metal.ops import MlxOps

        self.ops = MlxOps()
        self._dtypes = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
        self._names = {v: k for k, v in self._dtypes.items()} | {mx.int32: "int32", mx.int64: "int64",
                                                                 mx.bool_: "bool"}
        self._last_embedding: tuple | None = None  # (host array, dtype, tensor) until the next upload

    @classmethod
    def kv_cache_dtypes(cls, compute_dtype):
        """Any float dtype: write_kv casts to the cache's dtype, and paged_attention computes in
        float32 when the cache and the queries differ."""
        return (compute_dtype, *(d for d in cls.dtypes if d != compute_dtype))

    @classmethod
    def probe(cls) -> Probe:
        if mx is None:
            return Probe(False, f"mlx is not installed ({_MLX_IMPORT_ERROR}); pip install 'candelabra[metal]'")
        if mx.metal.is_available():
            return Probe(True, detail=f"gpu (Apple Metal, MLX {mx.__version__})", priority=100)
        # MLX's CPU build is correct but slower than numpy: auto takes it only when nothing else runs.
        return Probe(True, detail=f"cpu (MLX {mx.__version__} CPU build, slower than the numpy backend)", priority=5)

    def to_device(self, array, dtype=None):
        array = np.asarray(array)
        if array.dtype.kind == "f":
            target = self._dtypes[self.check_dtype(dtype or "float32")]
            return mx.array(array.astype(np.float32, copy=False)).astype(target)
        if array.dtype.kind in "iub":
            return mx.array(array)
        raise TypeError(f"cannot move an array of dtype {array.dtype} to the metal backend")

    def to_host(self, tensor):
        if tensor.dtype == mx.bfloat16:
            tensor = tensor.astype(mx.float32)
        return np.array(tensor, copy=True)

    def dtype_of(self, tensor):
        return self._names.get(tensor.dtype, str(tensor.dtype))

    def zeros(self, shape, dtype):
        return mx.zeros(shape, dtype=self._dtypes[self.check_dtype(dtype)])

    def upload_weight(self, name, role, weight, dtype):
        # A tied LM head comes right after the embedding, as the same host array: one tensor for both.
        last, self._last_embedding = self._last_embedding, None
        if role is WeightRole.LM_HEAD and last is not None and last[0] is weight and last[1] == dtype:
            return last[2]
        if isinstance(weight, QuantizedTensor):
            from candelabra.backends.metal.quantized import MlxInt4Weight

            tensor = MlxInt4Weight.from_quantized(weight, self._dtypes[self.check_dtype(dtype)])
        else:
            tensor = super().upload_weight(name, role, weight, dtype)
        if role is WeightRole.EMBEDDING:
            self._last_embedding = (weight, dtype, tensor)
        return tensor

    def free_memory(self) -> int:
        if mx.metal.is_available():
            limit = mx.device_info()["max_recommended_working_set_size"]
            return int(limit - mx.get_active_memory())
        return int(psutil.virtual_memory().available)

    def kv_cache_fraction(self) -> float:
        """Half of the GPU's working set; on the CPU build a quarter of the host's RAM, as cpu."""
        return 0.5 if mx.metal.is_available() else 0.25

    def shares_host_memory(self) -> bool:
        return True  # Apple silicon's unified memory: the GPU's arrays are in the host's RAM

    def synchronize(self) -> None:
        mx.synchronize()

    def evaluate(self, *values) -> None:
        # Queued, not waited for: whatever reads the values (fetch, to_host) waits for them, and meanwhile the
        # host goes on, with --async-scheduling building the next step.
        mx.async_eval(*values)

    def step_executor(self, model) -> StepExecutor:
        return MetalStepExecutor(self, model)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        caches = [KVCache(self.zeros(spec.block_shape, spec.dtype), self.zeros(spec.value_block_shape, spec.dtype))
                  for _ in range(spec.num_layers)]
        mx.eval(caches)
        return caches

    def allocate_swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        # Host memory: numpy arrays, outside MLX's working set. bfloat16 blocks travel as float32.
        host_dtype = np.float16 if spec.dtype == "float16" else np.float32
        return [KVCache(np.zeros(spec.block_shape, host_dtype), np.zeros(spec.value_block_shape, host_dtype))
                for _ in range(spec.num_layers)]

    def copy_blocks(self, caches, mapping):
        src, dst = _pairs(mapping)
        return [KVCache(_set_rows(c.key, dst, c.key[src]), _set_rows(c.value, dst, c.value[src])) for c in caches]

    def swap_out(self, caches, swap, mapping):
        device_blocks, host_blocks = _pairs(mapping)
        for cache, host in zip(caches, swap):
            host.key[host_blocks] = self.to_host(cache.key[device_blocks])
            host.value[host_blocks] = self.to_host(cache.value[device_blocks])
        return swap

    def swap_in(self, caches, swap, mapping):
        host_blocks, device_blocks = _pairs(mapping)
        return [
            KVCache(
                _set_rows(cache.key, device_blocks, mx.array(host.key[host_blocks]).astype(cache.key.dtype)),
                _set_rows(cache.value, device_blocks, mx.array(host.value[host_blocks]).astype(cache.value.dtype)),
            )
            for cache, host in zip(caches, swap)
        ]

    def prepare_step(self, meta: StepMetadata):
        from candelabra.backends.metal.attention import MlxStep

        return MlxStep.prepare(meta, gather_groups(meta))

    def prepare_sampling(self, meta: SamplingMetadata):
        prepared = super().prepare_sampling(meta)
        # Whether any row filters by rank is known here, on the host: rows that don't need the
        # vocabulary sorted skip the sort.
        prepared.needs_sort = bool(np.any(meta.top_k > 0) or np.any(meta.top_p < 1))
        return prepared


def _pairs(mapping) -> tuple:
    mapping = np.asarray(mapping, dtype=np.int64).reshape(-1, 2)
    return mx.array(mapping[:, 0]), mx.array(mapping[:, 1])


def _set_rows(array, rows, values):
    """Item assignment gives the same Python object a new, lazily computed value: the caller's
    handle sees the update, as with numpy, and MLX can reuse the buffer."""
    array[rows] = values
    return array


class MetalStepExecutor(StepExecutor):
    """The default executor, but the tokens a step takes from the step before (scheduled ahead) are written
    into its token ids inside MLX's graph, so that building the step does not wait for the one before."""

    def token_ids(self, inputs: StepInputs, feed: TokenFeed | None):
        ids = mx.array(inputs.token_ids)
        if feed is not None:
            ids[mx.array(feed.positions)] = feed.source[mx.array(feed.rows)].astype(ids.dtype)
        return ids
