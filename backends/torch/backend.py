"""The PyTorch backend: everything device-generic for any torch device, and the CPU device itself.

`TorchBackend` owns memory and dtypes, the KV cache and its swap space, block copies, the prepared
step as torch tensors, and a step executor that runs without autograd. What differs between the
host's RAM and a device's own memory is asked of its placement (`placement.py`), chosen once. A
backend for another torch device subclasses it with its `device_type`, its probe, and the ops it
overrides (`ops_class`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from candelabra.backends.torch.cpu.features import default_dtypes, has_native_bfloat16, usable_cores
from candelabra.backends.torch.dtypes import torch_dtype
from candelabra.core.contract.backend import Backend, Probe
from candelabra.core.contract.device import Device
from candelabra.core.contract.executor import StepExecutor, StepInputs, TokenFeed
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata
from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QUANTIZED_FORMATS, QuantizedTensor, RowStack, WeightRole

try:
    import torch
except Exception as exc:  # noqa: BLE001 - probe() reports why torch cannot be used
    torch = None
    _TORCH_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

log = logging.getLogger("candelabra")

CPU_DTYPES = default_dtypes(has_native_bfloat16())


def cpu_kernels_described() -> str:
    """Which of the C kernels' ISA variants this CPU runs, or why none, and that torch's own ops serve then."""
    from candelabra.backends.torch.cpu.kernel_library import kernels

    loaded = kernels()
    if loaded.library is None:
        return f"no C kernels, torch's own ops serve: {loaded.detail}"
    return f"C kernels: {loaded.variant}"


class TorchBackend(Backend):
    """PyTorch on one torch device. Subclasses set `device_type` and may override `ops_class`."""

    name = "torch"
    device_type: ClassVar[str] = "cpu"
    dtypes = CPU_DTYPES
    # Every GGUF format and grouped int4 format (GPTQ, AWQ) reaches `upload_weight` still quantized; it
    # keeps what its kernels take and dequantizes the rest itself, so the choice can depend on the compute dtype.
    quantized_formats = frozenset(QUANTIZED_FORMATS)
    # On a CPU the embedding table stays quantized too, shared with a tied LM head: the default
    # model's table is 136 MB as int8 rows against 272 as bfloat16, on top of its LM head's 136. A MoE
    # layer's experts are kept one by one as linear weights are (`upload_quantized_experts`).
    quantized_roles = QUANTIZABLE_ROLES | {WeightRole.EMBEDDING, WeightRole.EXPERTS}
    # A fused projection of parts in different formats is kept part by part (`upload_row_stack`), not dense.
    keeps_row_stacks = True
    # The torch.distributed process-group backend its communicator uses: Gloo sums CPU tensors.
    distributed_backend: ClassVar[str] = "gloo"

    def __init__(self, device: Device | None = None) -> None:
        if torch is None:
            raise RuntimeError(self.probe().reason)
        super().__init__(device)
        runs_on = self.runs_on()
        self.torch_device = torch.device(runs_on, self.device.index) if runs_on != "cpu" else torch.device("cpu")
        self.ops = self.ops_class()(self.torch_device)
        self._last_embedding: tuple | None = None  # (host array, dtype, tensor) until the next upload
        from candelabra.backends.torch.placement import DevicePlacement, HostPlacement

        self.placement = (HostPlacement(self.torch_device) if self.torch_device.type == "cpu"
                          else DevicePlacement(self.torch_device, self.distributed_backend))
        self._configure_device()

    @classmethod
    def runs_on(cls) -> str:
        """The torch device type the tensors live on: `device_type`, unless a subclass stands in for it."""
        return cls.device_type

    @classmethod
    def ops_class(cls) -> type:
        from candelabra.backends.torch.ops import TorchOps

        return TorchOps

    @classmethod
    def probe(cls) -> Probe:
        if torch is None:
            return Probe(False, f"torch is not installed ({_TORCH_IMPORT_ERROR}); pip install 'candelabra[torch]'")
        arithmetic = "bfloat16 in hardware" if has_native_bfloat16() else "no bfloat16 in hardware: float32"
        return Probe(True, detail=f"cpu ({usable_cores()} cores, torch {torch.__version__}, {arithmetic}; "
                                  f"{cpu_kernels_described()})", priority=50)

    def _configure_device(self) -> None:
        """On a CPU: its cores, threads and freed memory (`HostPlacement.configure`). A device backend
        configures its own device."""
        self.placement.configure(self.device, self.dtypes[0])

    @classmethod
    def device_count(cls) -> int:
        """On a CPU, tensor-parallel ranks share the cores: device i is the i-th share of them, so there are
        as many devices as cores (one core each at most)."""
        return usable_cores() if cls.runs_on() == "cpu" else super().device_count()

    def release_cached_memory(self) -> None:
        self.placement.release_cached_memory()

    def restore_thread_settings(self) -> None:
        self.placement.restore_thread_settings()

    @classmethod
    def kv_cache_dtypes(cls, compute_dtype):
        """Any float dtype: write_kv casts to the cache's dtype and attention reads it in the compute dtype.
        And int8 (quantized_kv.py): write_kv quantizes each row, attention dequantizes the blocks it reads."""
        return (compute_dtype, *(d for d in cls.dtypes if d != compute_dtype), "int8")

    # memory

    def to_device(self, array, dtype=None):
        array = np.asarray(array)
        if array.dtype.kind == "f":
            target = torch_dtype(self.check_dtype(dtype or "float32"))
            return torch.from_numpy(np.array(array, dtype=np.float32)).to(self.torch_device, target)
        if array.dtype.kind in "iub":
            return torch.from_numpy(np.array(array)).to(self.torch_device)
        raise TypeError(f"cannot move an array of dtype {array.dtype} to the {self.name} backend")

    def to_host(self, tensor):
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.detach().to("cpu").numpy().copy()

    def fetch(self, *tensors):
        return self.placement.fetch(self.to_host, tensors)

    def start_fetch(self, *tensors):
        return self.placement.start_fetch(self.to_host, tensors)

    def dtype_of(self, tensor):
        return str(tensor.dtype).removeprefix("torch.")

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=torch_dtype(self.check_dtype(dtype)), device=self.torch_device)

    def free_memory(self) -> int:
        return self.placement.free_memory()

    def kv_cache_fraction(self) -> float:
        """A device of its own gives half its free memory; the host's RAM, shared with everything, a quarter."""
        return self.placement.kv_cache_fraction

    def kv_cache_committed_on_write(self) -> bool:
        return self.placement.kv_cache_committed_on_write

    def runs_apart_from_host(self) -> bool:
        return self.placement.runs_apart_from_host

    def max_num_batched_tokens(self) -> int:
        return self.placement.max_num_batched_tokens or super().max_num_batched_tokens()

    def synchronize(self) -> None:
        self.placement.synchronize()

    # weights

    def upload_weight(self, name, role, weight, dtype):
        # A tied LM head comes right after the embedding, as the same host array or QuantizedTensor:
        # one tensor or handle for both, whose kernels are then taken for the LM head's matmuls.
        last, self._last_embedding = self._last_embedding, None
        if role is WeightRole.LM_HEAD and last is not None and last[0] is weight and last[1] == dtype:
            return self._kernels_as_lm_head(weight, last[2], dtype)
        if isinstance(weight, QuantizedTensor) and role is WeightRole.EXPERTS:
            tensor = self.upload_quantized_experts(name, weight, dtype)
        elif isinstance(weight, QuantizedTensor):
            tensor = self.upload_quantized(name, weight, dtype, role)
        elif isinstance(weight, RowStack):
            tensor = self.upload_row_stack(name, weight, dtype)
        else:
            tensor = self.to_device(weight, dtype)
        if role is WeightRole.EMBEDDING:
            self._last_embedding = (weight, dtype, tensor)
        return tensor

    def _kernels_as_lm_head(self, weight, kept, dtype):
        """An embedding table is kept in its most compact readable form with its default kernels (a lookup
        reads a few rows); tied to the LM head it also multiplies, so its form's kernels are taken from the
        kernel table then."""
        from candelabra.backends.torch.kernel_selection import Candidate
        from candelabra.backends.torch.weight_forms import KeptWeight

        if not isinstance(kept, KeptWeight) or not isinstance(weight, QuantizedTensor):
            return kept
        return self.kernel_selector(dtype).keep(weight.format, weight.shape, [Candidate(kept.form, lambda: kept)])

    def upload_quantized(self, name: str, weight: QuantizedTensor, dtype: str, role: WeightRole = WeightRole.LINEAR):
        """A weight still in a GGUF or grouped int4 format: on a CPU, kept in the form and multiplied by the kernels
        the kernel table names for its format and this CPU (kernel_table.py), else dequantized. An
        embedding table stays in a form whose rows can be read back, and a tied LM head shares it."""
        kept = self.placement.keep_quantized(weight, dtype, role, self.kernel_selector)
        if kept is None:
            return self.to_device(weight.dequantize(), dtype)
        return kept

    def upload_row_stack(self, name: str, stack: RowStack, dtype: str):
        """A fused projection of parts in different formats: each part kept as a linear weight of its format
        and shape is (`upload_quantized`), multiplied in turn; one dense tensor where every part came back dense."""
        from candelabra.backends.torch.row_stack import RowStackWeight

        kept = [self.upload_quantized(f"{name}[{index}]", part, dtype) for index, part in enumerate(stack.parts)]
        if all(isinstance(part, torch.Tensor) for part in kept):
            return torch.cat(kept)
        return RowStackWeight(kept)

    def upload_quantized_experts(self, name: str, experts: QuantizedTensor, dtype: str):
        """A MoE layer's stacked experts still in a quantized format: each expert kept as a linear weight of its
        format and shape is (`upload_quantized`), for `moe_experts` to multiply by the same kernels; one
        3-D tensor where every expert came back dense."""
        from candelabra.backends.torch.expert_weights import ExpertWeights

        kept = [self.upload_quantized(f"{name}[{index}]", expert, dtype)
                for index, expert in enumerate(experts.unstack())]
        if all(isinstance(expert, torch.Tensor) for expert in kept):
            return torch.stack(kept)
        return ExpertWeights(kept, experts.shape)

    def activation_rounding(self) -> str | None:
        """"int8" on a CPU where $CANDELABRA_INT8_ACTIVATIONS=1 lets kernels that round x to int8 serve."""
        from candelabra.backends.torch.kernel_table import int8_activations_from_environment

        return "int8" if self.runs_on() == "cpu" and int8_activations_from_environment() else None

    def kernel_selector(self, dtype: str):
        """The kernel selections of this process for `dtype` and this backend's share of the cores."""
        from candelabra.backends.torch.kernel_selection import selector_for

        return selector_for(dtype, usable_cores())

    @classmethod
    def kernel_tables(cls) -> list[str]:
        """The rows of the kernel table this CPU reads: its tuned table's, then those in code for its ISA level."""
        from candelabra.backends.torch.kernel_table import describe

        return describe() if cls.runs_on() == "cpu" else []

    @classmethod
    def tune_kernels(cls, dtypes: list[str] | None = None, formats: list[str] | None = None,
                     shapes: list[tuple[int, int]] | None = None, output: Path | None = None,
                     progress: Callable[[str], None] | None = None) -> str:
        """Time every form and kernel of each quantized format on this CPU (kernel_tuning.py) and write the
        ranking as this machine's tuned table, which serve then reads before the table in code."""
        from candelabra.backends.torch.kernel_tuning import TUNE_SHAPES, report, shapes_for, tune

        if cls.runs_on() != "cpu":
            raise ValueError(f"the torch backend picks kernels by a table on a CPU only; here it runs on "
                             f"{cls.runs_on()}")
        unknown = sorted(set(formats or ()) - set(QUANTIZED_FORMATS))
        if unknown:
            raise ValueError(f"no quantized format {', '.join(unknown)}: the torch backend keeps "
                             f"{', '.join(QUANTIZED_FORMATS)}")
        wrong_dtypes = sorted(set(dtypes or ()) - set(CPU_DTYPES))
        if wrong_dtypes:
            raise ValueError(f"no compute dtype {', '.join(wrong_dtypes)}: the torch backend computes in "
                             f"{', '.join(CPU_DTYPES)}")
        shapes = shapes or list(TUNE_SHAPES)
        for format in formats or QUANTIZED_FORMATS:
            if not shapes_for(format, shapes):
                raise ValueError(f"{format} needs K in whole blocks or groups; none of the shapes "
                                 f"{', '.join(f'{n}x{k}' for n, k in shapes)} has it")
        threads = usable_cores()
        torch.set_num_threads(threads)
        path, tuned = tune(dtypes or [CPU_DTYPES[0]], formats or QUANTIZED_FORMATS, threads, shapes=shapes,
                           output=output, progress=progress)
        return f"{report(tuned, threads)}\nwritten to {path}; serve reads it on this machine at {threads} threads"

    # experts in host memory

    def shares_host_memory(self) -> bool:
        return self.placement.shares_host_memory

    def host_experts(self, name, weight, dtype):
        host = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)).to(torch_dtype(self.check_dtype(dtype)))
        return host.pin_memory() if self.placement.pins_host_memory else host

    def write_expert(self, experts, slot, host, index):
        experts[slot].copy_(host[index], non_blocking=True)

    # communication

    def communicator(self, master_addr: str, master_port: int, timeout_s: float = 60.0,
                     while_waiting: Callable[[], None] | None = None):
        """torch.distributed's default process group over `distributed_backend` (Gloo where the tensors
        are in host RAM), joined over TCP."""
        from candelabra.backends.torch.communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(self.placement.distributed_library, master_addr, master_port,
                                            self.device.rank, self.device.world_size, timeout_s, self.torch_device,
                                            while_waiting)

    # KV cache

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        return self.placement.kv_cache(spec)

    def allocate_swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        return self.placement.swap_space(spec)

    def copy_blocks(self, caches, mapping):
        src, dst = self._pairs(mapping, self.torch_device, self.torch_device)
        for cache in caches:
            cache.key.index_copy_(0, dst, cache.key.index_select(0, src))
            cache.value.index_copy_(0, dst, cache.value.index_select(0, src))
        return caches

    def swap_out(self, caches, swap, mapping):
        device_blocks, host_blocks = self._pairs(mapping, self.torch_device, torch.device("cpu"))
        for cache, host in zip(caches, swap):
            host.key.index_copy_(0, host_blocks, cache.key.index_select(0, device_blocks).to("cpu"))
            host.value.index_copy_(0, host_blocks, cache.value.index_select(0, device_blocks).to("cpu"))
        return swap

    def swap_in(self, caches, swap, mapping):
        host_blocks, device_blocks = self._pairs(mapping, torch.device("cpu"), self.torch_device)
        for cache, host in zip(caches, swap):
            cache.key.index_copy_(0, device_blocks, host.key.index_select(0, host_blocks).to(self.torch_device))
            cache.value.index_copy_(0, device_blocks, host.value.index_select(0, host_blocks).to(self.torch_device))
        return caches

    @staticmethod
    def _pairs(mapping, first_device, second_device):
        mapping = torch.from_numpy(np.asarray(mapping, dtype=np.int64).reshape(-1, 2))
        return mapping[:, 0].to(first_device), mapping[:, 1].to(second_device)

    # the step

    def step_executor(self, model: Any) -> StepExecutor:
        return TorchStepExecutor(self, model)

    def prepare_step(self, meta: StepMetadata):
        from candelabra.backends.torch.attention import TorchStep

        return TorchStep.prepare(meta, self.torch_device)

    def prepare_sampling(self, meta: SamplingMetadata):
        from candelabra.backends.torch.sampling import TorchSampling

        return TorchSampling.prepare(meta, self.torch_device)


class TorchStepExecutor(StepExecutor):
    """The default executor with autograd off (no graph is recorded for a forward that is never
    differentiated), on every core from whichever thread steps: torch's thread count belongs to
    the thread that set it, and a server steps on a thread of its own, where the default ran the
    default model's decode step 1.3 to 1.5 times slower."""

    def __init__(self, backend: Any, model: Any) -> None:
        super().__init__(backend, model)
        self._configured = threading.local()

    def warm_up(self, caches: list[KVCache], max_num_seqs: int) -> None:
        """The model is loaded and the caches allocated: the kernels its weights use are logged, and
        what loading freed goes back to the OS (freed memory is otherwise kept for the steps'
        temporaries, on a CPU)."""
        from candelabra.backends.torch.kernel_selection import log_selections

        log_selections()
        self.backend.release_cached_memory()

    def run(self, inputs: StepInputs, caches: list[KVCache], feed: TokenFeed | None = None):
        if not getattr(self._configured, "threads", False):
            torch.set_num_threads(usable_cores())
            self._configured.threads = True
        with torch.inference_mode():
            return super().run(inputs, caches, feed)

    def token_ids(self, inputs: StepInputs, feed: TokenFeed | None):
        return device_token_ids(self.backend, inputs.token_ids, feed)


def device_token_ids(backend: Any, token_ids: np.ndarray, feed: TokenFeed | None):
    """`token_ids` on the device, the fed ones copied there from the previous step's samples on the device:
    nothing waits for that step."""
    ids = backend.to_device(token_ids)
    if feed is not None:
        feed_tokens(ids, feed)
    return ids


def feed_tokens(ids, feed: TokenFeed) -> None:
    """Write the fed tokens into `ids` (a device tensor of the step's token ids), on the device."""
    from candelabra.backends.torch.batched_upload import upload

    positions, rows = upload([(feed.positions, torch.int64), (feed.rows, torch.int64)], ids.device)
    ids.index_copy_(0, positions, feed.source.index_select(0, rows).to(ids.dtype))
