"""The backend contract: the only way the core touches hardware.

A backend subclasses `Backend`, gives it a `name`, and registers the class through the plugin
hook `register_backends` (see `candelabra.plugins`). The core then:

* asks `probe()` whether it can run here, and why not, and constructs it for a `Device`;
* moves data with `to_device` / `to_host`, and weights, named and with their role, dense or
  still quantized in a format it declares in `quantized_formats`, with `upload_weight`;
* keeps some of a mixture-of-experts model's experts in host memory where asked, and copies each
  into a device row when it is routed to (`host_experts`, `write_expert`; optional);
* allocates the paged KV cache (`allocate_kv_cache`) and host swap space
  (`allocate_swap_space`), and copies or swaps whole blocks between steps;
* hands each step to the backend's executor (`step_executor`), which by default turns the step's
  host metadata into backend tensors once (`prepare_step`, `prepare_sampling`) and runs the model
  graph on `ops`; then calls `evaluate` once on the step's results and caches, so that a lazy
  backend (MLX) computes the whole step as one graph, and `fetch`es the sampled tokens to the host
  in one transfer.

Every call that changes a cache or swap space returns it, so a backend with immutable arrays
(MLX) returns new ones while numpy and torch may change them in place and return the same objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import InitVar, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.device import Device
from candelabra.core.contract.dtypes import DType, KVDType, check_dtype, check_kv_dtype
from candelabra.core.contract.executor import StepExecutor
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache, Ops, Tensor
from candelabra.core.contract.step_metadata import SamplingMetadata, StepMetadata
from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QuantizedTensor, RowStack, WeightRole


@dataclass(frozen=True)
class Probe:
    """Whether a backend can run on this machine: `reason` says why not, `detail` what it runs on, in
    words ("npu 0 (64 GiB)"; shown after the backend's name, so without it).

    `priority` ranks the available backends for `--backend auto`, higher first (ties go to the
    name that sorts first): 100 an accelerator (GPU, NPU); 50 a fast CPU path; 10 the numpy
    reference; 0 a backend that does not say. A backend that runs here but slower than the
    reference answers below 10 and says so in `detail`.

    `device=` is the first contract's name for `detail`, still taken (a `Device` is what
    `Backend.device` is; this is a description).
    """

    available: bool
    reason: str = ""
    detail: str = ""
    priority: int = 0
    device: InitVar[str | None] = None

    def __post_init__(self, device: str | None) -> None:
        if device is not None:
            if self.detail:
                raise TypeError("Probe takes detail= or its old name device=, not both")
            object.__setattr__(self, "detail", device)


CONTRACT_PAGE = "docs/backend-contract.md"


class Backend(ABC):
    """Base class of every backend. Subclasses set `name`, `dtypes` and `ops`, and implement the
    abstract methods (`REQUIRED`: probe, memory, the KV cache and its blocks); every other method
    has a working default. CONTRACT_PAGE's table lists each member, required or optional."""

    name: ClassVar[str] = ""
    # Compute dtypes this backend runs ops in; the first is its default.
    dtypes: ClassVar[tuple[DType, ...]] = ("float32",)
    # Quantized GGUF formats ("Q4_K", ...) whose weights of `quantized_roles` `upload_weight` takes
    # still quantized; the core dequantizes every other weight first.
    quantized_formats: ClassVar[frozenset[str]] = frozenset()
    # Linear and LM-head weights by default; a backend whose `Ops.embedding` reads rows of its own
    # quantized handle adds WeightRole.EMBEDDING, and one whose `Ops.moe_experts` multiplies by its own
    # handles of quantized experts WeightRole.EXPERTS.
    quantized_roles: ClassVar[frozenset[WeightRole]] = QUANTIZABLE_ROLES
    # Whether `upload_weight` takes a linear weight fused from parts stored in different formats it keeps
    # (q and k in Q5_0, v in Q8_0) as a `RowStack`, each part still quantized; without, the core joins them
    # dequantized to float32.
    keeps_row_stacks: ClassVar[bool] = False
    # Set by the engine before it asks for a step executor (`--disable-cuda-graph`): run every step
    # op by op, capturing and compiling nothing. A backend that never captures ignores it.
    eager_steps: bool = False
    ops: Ops

    def __new__(cls, *args: Any, **kwargs: Any) -> Backend:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(f"{cls.__name__} does not implement {', '.join(missing)}, which every backend must; "
                            f"{CONTRACT_PAGE} ('What a backend implements') says what each must do")
        return super().__new__(cls)

    def __init__(self, device: Device | None = None) -> None:
        """A backend for `device` (None: device 0). Subclasses call this first, then set `ops`."""
        self.device = self.check_device(device or Device())

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Report availability without raising: a missing library or device is a reason string."""
        raise NotImplementedError(_required("probe", cls, "say whether the backend can run here, and why not"))

    @classmethod
    def device_count(cls) -> int:
        """How many devices this backend can run on here, numbered from 0."""
        return 1

    @classmethod
    def check_device(cls, device: Device) -> Device:
        """`device` if this backend has it here, else a ValueError naming the devices it has."""
        count = cls.device_count()
        if device.index >= count:
            has = "one device, 0" if count == 1 else f"devices 0 to {count - 1}"
            raise ValueError(f"backend {cls.name!r} has no device {device.index}; it has {has}")
        return device

    def check_dtype(self, dtype: str) -> DType:
        """`dtype` if this backend computes in it, else a ValueError naming the ones it does."""
        if check_dtype(dtype) not in self.dtypes:
            raise ValueError(f"backend {self.name!r} does not compute in {dtype}; it offers {', '.join(self.dtypes)}")
        return dtype  # type: ignore[return-value]

    @classmethod
    def kv_cache_dtypes(cls, compute_dtype: DType) -> tuple[KVDType, ...]:
        """The dtypes `write_kv` and `paged_attention` take a cache in while computing in
        `compute_dtype` (the cache is in the compute dtype unless asked otherwise): float dtypes, or
        the quantized "int8" and "fp8" (kv_cache.py has their layout). Unless a backend says more: the
        compute dtype alone."""
        return (compute_dtype,)

    @classmethod
    def check_kv_cache_dtype(cls, kv_dtype: str, compute_dtype: DType) -> KVDType:
        """`kv_dtype` if this backend keeps a KV cache in it beside `compute_dtype`, else a ValueError
        naming the ones it does."""
        offered = cls.kv_cache_dtypes(compute_dtype)
        if check_kv_dtype(kv_dtype) not in offered:
            raise ValueError(f"backend {cls.name!r} computing in {compute_dtype} keeps its KV cache in "
                             f"{', '.join(offered)}, not {kv_dtype}")
        return kv_dtype  # type: ignore[return-value]

    # memory

    @abstractmethod
    def to_device(self, array: np.ndarray, dtype: DType | None = None) -> Tensor:
        """A backend tensor holding `array`. Float arrays (float64 included) become `dtype` when given,
        else float32; integer arrays (the core sends int32, and int64 only where a test does) keep an
        integer type, int64 narrowed to int32 or not. The core sends no bool arrays (masks travel as
        int32 bit words). The backend may keep `array` itself instead of a copy where its memory is the
        host's: the caller never changes an array it handed over."""
        raise NotImplementedError(_required("to_device", self, "move a host array to the device"))

    @abstractmethod
    def to_host(self, tensor: Tensor) -> np.ndarray:
        """A numpy copy of `tensor`; bfloat16 comes back as float32."""
        raise NotImplementedError(_required("to_host", self, "copy a device tensor to a numpy array"))

    def fetch(self, *tensors: Tensor) -> tuple[np.ndarray, ...]:
        """Numpy copies of `tensors` in one device-to-host transfer: the model runner calls this
        once per step, for everything the step returns to the host. The default calls `to_host`
        on each, which is one transfer where the host reads device memory directly (numpy, MLX on
        unified memory); a backend with memory of its own packs the tensors first."""
        return tuple(self.to_host(tensor) for tensor in tensors)

    def start_fetch(self, *tensors: Tensor) -> Callable[[], tuple[np.ndarray, ...]]:
        """`fetch` begun now and finished when the returned function is called, which waits for the
        tensors and returns their numpy copies. Between the two the engine gives the device its next
        step, so a device that runs asynchronously should start the copy here, behind the work already
        queued, or the copy would wait for that next step too. The default fetches when called: right for
        a backend that computes as it is called, or lazily on fetch."""
        return lambda: self.fetch(*tensors)

    @abstractmethod
    def dtype_of(self, tensor: Tensor) -> str:
        """The dtype name of a backend tensor: a compute dtype, "int32" or "int64". Conformance uses it
        to check outputs' dtypes and to poison float inputs with NaN."""
        raise NotImplementedError(_required("dtype_of", self, "name a device tensor's dtype"))

    @abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: DType) -> Tensor:
        """A tensor of zeros of `shape` in `dtype` (a compute or KV cache dtype), for caches and the
        conformance harness."""
        raise NotImplementedError(_required("zeros", self, "make a tensor of zeros"))

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes this backend could still allocate, for sizing the KV cache when the user gives no size:
        it takes `kv_cache_fraction()` of them. A device whose memory is the host's RAM answers the RAM
        available to programs (psutil's `virtual_memory().available`) and lowers `kv_cache_fraction`."""
        raise NotImplementedError(_required("free_memory", self, "say how many bytes it could still allocate"))

    def kv_cache_fraction(self) -> float:
        """The share of `free_memory()` the KV cache takes when no size is given: a device of its
        own may give more; a backend whose free memory is the host's RAM, shared with everything
        else, less."""
        return 0.5

    def runs_apart_from_host(self) -> bool:
        """Whether a call returns before the device has computed it (a CUDA stream's queue), so that the
        host can build the next step meanwhile. The engine then schedules each step ahead unless told not
        to (`--no-async-scheduling`). Default: False, for a backend whose results are computed by the
        host's own cores (numpy, torch on the CPU), where scheduling ahead overlaps nothing."""
        return False

    def activation_rounding(self) -> str | None:
        """"int8" where this backend's kernels for quantized weights may round x to 8-bit integers (per block
        along K, as llama.cpp multiplies) before the product, as a user may allow for speed; None where every
        product is exact to the compute dtype. The conformance suite's models and parallel levels then hold quantized
        checkpoints to limits that admit that rounding. Default: None."""
        return None

    def kv_cache_committed_on_write(self) -> bool:
        """Whether the KV cache's memory is taken from the system only where a block is first
        written (host RAM, allocated untouched). The engine then reuses written blocks, the prefix
        cache's included, before it writes a fresh one, so that resident memory follows the load
        served instead of growing with the prefix cache to the whole cache. Default: False (the
        cache is the device's from the start)."""
        return False

    def max_num_batched_tokens(self) -> int:
        """The most tokens one step takes (with chunked prefill) where the user sets no limit. Where a
        step's time grows with its tokens (a CPU), a smaller step needs less memory for its
        temporaries and delays the sequences decoding beside a prefill less, at the same
        throughput."""
        return 2048

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until all work handed to the device so far has finished (nothing to do for a backend
        whose calls return finished results). Conformance calls it after every op, so a lazy or
        asynchronous op's failure shows at the op that caused it."""
        raise NotImplementedError(_required("synchronize", self, "wait for the device's work"))

    def release_cached_memory(self) -> None:
        """Give back to the system what this backend keeps for reuse between steps (freed host
        memory, an allocator's cache). A server calls it once it has been idle for a while, so
        that the memory its busiest steps needed is not held while nothing runs. The default
        does nothing."""

    def restore_thread_settings(self) -> None:
        """(optional) Undo what the constructor changed on the thread that built this backend (a CPU
        backend's share of the cores, as one of several ranks, and its thread count), once the model
        it serves is closed: that thread goes on as it was before. Safe to call more than once. The
        default changes nothing, so has nothing to undo."""

    def kernel_record(self) -> dict[str, str]:
        """For a backend that replaces some ops with vendor kernels (an override table): which ran
        since the last call, as op name -> "override", "fell back" (the backend's base op ran, the
        kernel missing or declining the call) or "override, fell back" (both); then forget it.
        Conformance reports it per case. Default: nothing is overridden, {}."""
        return {}

    @classmethod
    def kernel_tables(cls) -> list[str]:
        """(optional) For a backend that picks among several kernels by a table or by timing them: the
        tables it reads or measured on this machine, as text, for `candelabra backends --kernels`.
        Default: none."""
        return []

    @classmethod
    def tune_kernels(cls, dtypes: list[str] | None = None, formats: list[str] | None = None,
                     shapes: list[tuple[int, int]] | None = None, output: Path | None = None,
                     progress: Callable[[str], None] | None = None) -> str:
        """(optional) For `candelabra tune`: measure this machine's kernels for the compute `dtypes`, weight
        `formats` and weight `shapes` [N, K] (None: the backend's defaults), write what serve is to read on
        this machine (to `output`, or where the backend reads it), calling `progress` with what is being
        measured, and return the report. Default: this backend has nothing to tune (NotImplementedError)."""
        raise NotImplementedError(f"the {cls.name} backend has no kernels to tune")

    def evaluate(self, *values: Any) -> None:
        """Compute `values` (tensors, KVCaches, or tuples and lists of them) now. A lazy backend
        builds a whole step as one graph and the model runner calls this once per step, on the
        step's outputs and updated caches; an eager backend has already computed them."""

    # weights

    def upload_weight(self, name: str, role: WeightRole, weight: np.ndarray | QuantizedTensor | RowStack,
                      dtype: DType) -> Tensor:
        """The model's weight `name` (its checkpoint name, e.g. "model.layers.0.mlp.down_proj.weight";
        a fused projection carries the fused name, "...qkv_proj.weight") for the op its `role` feeds.

        `weight` is a float32 host array, or a `QuantizedTensor` when the role is in
        `quantized_roles` and its format is in `quantized_formats` (for role experts, the 3-D stack
        of a MoE layer's experts), or with `keeps_row_stacks` a `RowStack` (role linear): a fused
        projection whose parts are in different such formats, which multiplies as its parts' products
        side by side. What this returns is what the op receives: `Ops.linear` takes
        whatever came back for roles linear and lm_head, and `Ops.moe_experts` for role experts,
        so a backend may keep its own layout or a packed handle there; `Ops.embedding` takes the
        embedding role's table (a tensor of `dtype`, or the backend's own handle where embedding is
        among its `quantized_roles`) and the norm ops the norm role's weights, which must be
        tensors of `dtype`. A tied LM head arrives a second time, right after the embedding and
        under its name, with role lm_head (the very same host array or QuantizedTensor when the
        embedding's form suits the LM head too), so it may be kept in another layout, or be the
        embedding's handle again. The backend may keep `weight` itself: the caller does not change
        it afterwards.
        """
        if isinstance(weight, (QuantizedTensor, RowStack)):
            kind = weight.format if isinstance(weight, QuantizedTensor) else " and ".join(weight.formats)
            raise TypeError(f"backend {self.name!r} got {name} as {kind} blocks, but its upload_weight "
                            "takes dense weights only; override upload_weight to keep quantized_formats")
        return self.to_device(weight, dtype)

    # experts in host memory (--num-experts-offload-per-rank)

    def shares_host_memory(self) -> bool:
        """Whether this backend's tensors are in the host's memory (numpy, torch on a CPU, Apple's
        unified memory), so that keeping some of a model's experts "in host memory" changes nothing:
        the core then keeps them all where `upload_weight` puts them, and says so. Default: False."""
        return False

    def host_experts(self, name: str, weight: np.ndarray, dtype: DType) -> Any:
        """(optional) Experts kept in host memory, for `write_expert` to copy from: `weight` is
        float32 [N, out, in], N experts of one projection of the MoE layer's EXPERTS weight `name`
        (gate_up or down), to be held in `dtype` where the device copies from fastest (pinned
        memory, where it has it). The core never changes `weight` afterwards."""
        raise NotImplementedError(cannot_offload_experts(self))

    def write_expert(self, experts: Tensor, slot: int, host: Any, index: int) -> None:
        """(optional) Copy expert `index` of `host` (what `host_experts` returned) over row `slot` of
        `experts` (what `upload_weight` returned for the same projection, role EXPERTS), in place. The
        copy may run asynchronously, but every op called after it must read the new row, and no op
        called before it may read it (the torch backend queues a non-blocking copy on the stream the
        ops run on)."""
        raise NotImplementedError(cannot_offload_experts(self))

    # KV cache

    @abstractmethod
    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        """One KVCache per layer in `spec.dtype`: key of `spec.block_shape`, value of
        `spec.value_block_shape` (the two differ for a latent cache). Its content before the
        first write does not matter (zeros or not): slots not written yet are never read as keys."""
        raise NotImplementedError(_required("allocate_kv_cache", self, "allocate the paged KV cache"))

    @abstractmethod
    def allocate_swap_space(self, spec: KVCacheSpec) -> list[KVCache]:
        """Host memory for `spec.num_blocks` blocks of every layer: one KVCache per layer shaped as
        `allocate_kv_cache`'s, held in host memory (numpy arrays, or tensors that `to_host` reads; pinned
        where the device copies faster from pinned memory), in `spec.dtype` or, where the host has no
        such type (bfloat16 in numpy), a wider one that holds its values exactly (float32).
        Conformance reads it to check `swap_out` apart from `swap_in`."""
        raise NotImplementedError(_required("allocate_swap_space", self, "allocate host swap space"))

    @abstractmethod
    def copy_blocks(self, caches: list[KVCache], mapping: np.ndarray) -> list[KVCache]:
        """Copy whole blocks within the device cache of every layer. `mapping` [N, 2] int holds
        (source, destination) pairs; sources and destinations are disjoint sets."""
        raise NotImplementedError(_required("copy_blocks", self, "copy KV blocks"))

    @abstractmethod
    def swap_out(self, caches: list[KVCache], swap: list[KVCache], mapping: np.ndarray) -> list[KVCache]:
        """Copy device blocks to host blocks: `mapping` [N, 2] int holds (device, host) pairs.
        Returns the updated swap space; the device caches stay as they are."""
        raise NotImplementedError(_required("swap_out", self, "copy KV blocks to the host"))

    @abstractmethod
    def swap_in(self, caches: list[KVCache], swap: list[KVCache], mapping: np.ndarray) -> list[KVCache]:
        """Copy host blocks to device blocks: `mapping` [N, 2] int holds (host, device) pairs.
        Returns the updated caches; only the mapped device blocks change."""
        raise NotImplementedError(_required("swap_in", self, "copy KV blocks back from the host"))

    # communication

    def communicator(self, master_addr: str, master_port: int, timeout_s: float = 60.0,
                     while_waiting: Callable[[], None] | None = None) -> Communicator:
        """Join the group of `self.device.world_size` processes (one per device, tensor parallelism) as
        rank `self.device.rank`, meeting at `master_addr`:`master_port`, where rank 0 listens. Blocks
        until every rank has joined; fails when that, or any later collective call, takes longer than
        `timeout_s` seconds. While it waits for the others it calls `while_waiting` (if given) every
        fraction of a second, and what that raises ends the wait (rank 0 checks that the rank
        processes it started are still running). Call it once per process."""
        raise NotImplementedError(f"backend {self.name!r} offers no communicator, which tensor parallelism needs "
                                  "(several devices serving one model); serve on one device, or implement "
                                  "Backend.communicator on an existing distributed engine such as torch.distributed")

    # step execution

    def step_executor(self, model: Any) -> StepExecutor:
        """What runs each step of `model`: the default executor calls the ops one by one. A
        backend that captures or compiles steps returns its own (see `candelabra.core.contract.executor`)."""
        return StepExecutor(self, model)

    # step metadata

    def prepare_step(self, meta: StepMetadata) -> Any:
        """The step's metadata as backend tensors, built once and shared by every layer. The core reads
        `slot_mapping`, `rope_positions` and `logits_rows` from it; the rest is for the backend's own
        `paged_attention`. The default keeps each field of `StepMetadata` under its own name."""
        return _upload_arrays(self, meta)

    def prepare_sampling(self, meta: SamplingMetadata) -> Any:
        """The batch's sampling parameters as backend tensors, handed to `Ops.sample` as its `params`.
        The default keeps each field of `SamplingMetadata` under its own name (arrays uploaded, floats
        as float32; `num_top_logprobs` stays an int) plus `host`, the metadata itself; a backend that
        overrides it may return any object its own `sample` reads."""
        return _upload_arrays(self, meta)


def cannot_offload_experts(backend: Backend) -> str:
    """What a backend whose memory is its own, without `host_experts` and `write_expert`, answers to
    --num-experts-offload-per-rank."""
    return (f"backend {backend.name!r} cannot keep experts in host memory (--num-experts-offload-per-rank): it "
            f"does not implement Backend.host_experts and Backend.write_expert ({CONTRACT_PAGE}, 'Experts in host "
            "memory'); serve without the flag")


def _required(method: str, backend: Any, what: str) -> str:
    name = backend.__name__ if isinstance(backend, type) else type(backend).__name__
    return f"{name}.{method} must {what}: every backend implements it ({CONTRACT_PAGE}, 'What a backend implements')"


def _upload_arrays(backend: Backend, meta: Any) -> SimpleNamespace:
    """The fields of dataclass `meta`, numpy arrays moved to the backend (floats as float32),
    plus `host`, the original."""
    prepared = SimpleNamespace(host=meta)
    for field in fields(meta):
        value = getattr(meta, field.name)
        if isinstance(value, np.ndarray):
            value = backend.to_device(value, "float32" if value.dtype.kind == "f" else None)
        setattr(prepared, field.name, value)
    return prepared
