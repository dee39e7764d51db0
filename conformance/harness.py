"""Running one conformance case against a backend and judging it."""

from __future__ import annotations

import traceback
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from candelabra.conformance.compare import LOW_PRECISION, nmse, nmse_beside_rounding_flips, op_threshold, round_to
from candelabra.conformance.mismatch import describe_cache_slots, describe_mismatch
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.dtypes import FLOAT_DTYPES, QUANTIZED_KV_DTYPES
from candelabra.core.contract.ops import OP_NAMES, KVCache, OpNotSupported
from candelabra.core.contract.step_metadata import NO_SLOT
from candelabra.core.contract.weights import QuantizedTensor, WeightRole

PASSED, FAILED, NOT_SUPPORTED = "passed", "failed", "not supported"


@dataclass(frozen=True)
class Case:
    """One op (or contract call) at one dtype with one set of parameters."""

    op: str
    dtype: str
    params: tuple[tuple[str, Any], ...]
    check: Callable[..., None] = field(compare=False, repr=False)
    weight_format: str | None = None  # a quantized format the case's weight is in, e.g. "Q4_K"

    @property
    def id(self) -> str:
        described = "".join(f"-{k}={v}" for k, v in self.params)
        return f"{self.op}-{self.dtype}{described}".replace(" ", "")

    name = id


@dataclass
class CaseResult:
    case: str
    op: str
    dtype: str
    status: str
    worst_nmse: float | None
    seed: int
    message: str = ""
    weight_format: str | None = None
    # For a backend with vendor kernel overrides: "override", "fell back" or both, as it recorded.
    kernel: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class CaseFailure(AssertionError):
    pass


class Harness:
    """What a check uses: random inputs in the case's dtype, poisoned calls, comparisons."""

    def __init__(self, backend: Backend, dtype: str, seed: int, op: str | None = None) -> None:
        self.backend, self.dtype = backend, dtype
        self.rng = np.random.default_rng(seed)
        self.threshold = op_threshold(op, dtype)
        self.worst_nmse: float | None = None
        self.failures: list[str] = []
        self._weights: list[Any] = []

    def rand(self, *shape: int, scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
        """Normal random values, rounded to the case's dtype (float32 on the host)."""
        return round_to(self.rng.standard_normal(shape) * scale + offset, self.dtype)

    def upload(self, array: np.ndarray, dtype: str | None = None) -> Any:
        """To the backend: float arrays in `dtype` (default: the case's), integer arrays as int32."""
        if array.dtype.kind == "f":
            return self.backend.to_device(array, dtype or self.dtype)
        return self.backend.to_device(array.astype(np.int32))

    def upload_weight(self, name: str, role: WeightRole, weight: np.ndarray | QuantizedTensor) -> Any:
        """A weight as a model's reaches the backend; `call` passes it unpoisoned, since a backend
        may keep weights in a layout of its own that only `upload_weight` makes."""
        handle = self.backend.upload_weight(name, role, weight, self.dtype)
        self._weights.append(handle)
        return handle

    def upload_cache(self, key: np.ndarray, value: np.ndarray, dtype: str | None = None) -> KVCache:
        """A KV cache in `dtype` (default: the case's). A quantized cache's parts are given as the rows
        it stores (`stored_kv`) and go to the backend as those bytes."""
        if (dtype or self.dtype) in QUANTIZED_KV_DTYPES:
            return KVCache(self.backend.to_device(key), self.backend.to_device(value))
        return KVCache(self.upload(key, dtype), self.upload(value, dtype))

    def call(self, op: Callable, *args, **kwargs):
        """Run `op` once on NaN copies of its float tensor arguments other than weights (its result
        dropped), then for real: an output the backend leaves partly unwritten then shows NaN from
        the first run, since allocators hand freed memory straight back."""
        poisoned_args = [self._poisoned(a) for a in args]
        poisoned_kwargs = {k: self._poisoned(v) for k, v in kwargs.items()}
        try:
            poisoned_result = op(*poisoned_args, **poisoned_kwargs)
            self.backend.evaluate(poisoned_result)
            self.backend.synchronize()
            del poisoned_result
        except OpNotSupported:
            raise
        except Exception:  # noqa: BLE001 - NaN inputs may legitimately upset an op
            pass
        result = op(*args, **kwargs)
        self.backend.evaluate(result)
        self.backend.synchronize()
        return result

    def _poisoned(self, value: Any) -> Any:
        if any(value is weight for weight in self._weights):
            return value
        if isinstance(value, KVCache):
            return KVCache(self._poisoned_cache(value.key), self._poisoned_cache(value.value))
        dtype = self._float_dtype(value) if hasattr(value, "shape") else None
        if dtype is not None:
            return self.backend.to_device(np.full(tuple(value.shape), np.nan, dtype=np.float32), dtype)
        return value

    def _poisoned_cache(self, part: Any) -> Any:
        """A float cache part as any float tensor; a quantized one's bytes all 0xff: every row's codes -1
        (int8) or NaN (fp8), its scale NaN."""
        storage = self.backend.dtype_of(part)
        if storage in ("int8", "uint8"):
            return self.backend.to_device(np.full(tuple(part.shape), 0xFF, np.uint8).view(storage))
        return self._poisoned(part)

    def _float_dtype(self, value: Any) -> str | None:
        """The dtype of a float backend tensor, else None."""
        try:
            dtype = self.backend.dtype_of(value)
        except Exception:  # noqa: BLE001 - not a backend tensor
            return None
        return dtype if dtype in FLOAT_DTYPES else None

    def host(self, tensor: Any) -> np.ndarray:
        return self.backend.to_host(tensor)

    def close(self, name: str, output: Any, reference: np.ndarray, threshold: float | None = None) -> None:
        """Require NMSE(output, reference) <= the op's threshold at this dtype (or `threshold`). A
        backend tensor (a numpy array of float16 or bfloat16 too, as a numpy-based backend's are) is
        compared with the reference rounded once to its dtype, which is the exact
        result a low-precision op can give: what remains is the backend's own arithmetic. At float16
        and bfloat16 an output that is that result but for a few one-ulp rounding flips passes too
        (`nmse_beside_rounding_flips`)."""
        if isinstance(output, np.ndarray):  # a numpy backend's tensor, or a host copy the check made
            dtype = str(output.dtype) if str(output.dtype) in LOW_PRECISION else None
        else:
            dtype = self._float_dtype(output)
            output = self.host(output)
        if dtype is not None:
            reference = np.where(np.isfinite(reference), round_to(reference, dtype), reference)
        error = nmse(output, reference)
        self.worst_nmse = error if self.worst_nmse is None else max(self.worst_nmse, error)
        limit = self.threshold if threshold is None else threshold
        if error <= limit or (dtype in LOW_PRECISION and nmse_beside_rounding_flips(output, reference, dtype) <= limit):
            return
        self.failures.append(f"{name}: {describe_mismatch(output, reference, error, limit, dtype or self.dtype)}")

    def equal(self, name: str, output: Any, reference: np.ndarray) -> None:
        output = output if isinstance(output, np.ndarray) else self.host(output)
        if output.shape != reference.shape or not np.array_equal(output, reference):
            wrong = "shape " + str(output.shape) if output.shape != reference.shape else (
                f"{int(np.sum(output != reference))} of {reference.size} differ")
            self.failures.append(f"{name}: not equal ({wrong})")

    def slots_equal(self, name: str, output: Any, expected: np.ndarray, slots: np.ndarray,
                    new_rows: np.ndarray) -> None:
        """Require a cache part ([blocks, block_size, ...]) to equal `expected` after the step's rows
        `new_rows` went to `slots`, naming the kind of each slot that differs."""
        output = output if isinstance(output, np.ndarray) else self.host(output)
        problem = describe_cache_slots(output, expected, slots, new_rows, NO_SLOT)
        if problem:
            self.failures.append(f"{name}: {problem}")

    def require(self, name: str, condition: bool, detail: str = "") -> None:
        if not condition:
            self.failures.append(f"{name}: {detail}" if detail else name)


def case_seed(base_seed: int, case_name: str) -> int:
    """A case's own seed: fixed by the run's base seed and the case, so `--seed` reproduces a run."""
    return zlib.crc32(case_name.encode()) ^ base_seed


def run_case(backend: Backend, case: Case, seed: int) -> CaseResult:
    harness = Harness(backend, case.dtype, seed, case.op)
    backend.kernel_record()  # forget what ran before this case

    def result(status: str, message: str = "") -> CaseResult:
        return CaseResult(case.id, case.op, case.dtype, status, harness.worst_nmse, seed, message, case.weight_format,
                          backend.kernel_record().get(case.op))

    if case.op in OP_NAMES and not backend.ops.supports(case.op):
        return result(NOT_SUPPORTED, f"backend {backend.name!r} does not implement {case.op}")
    try:
        case.check(harness, **dict(case.params))
    except OpNotSupported as exc:
        return result(NOT_SUPPORTED, str(exc))
    except Exception as exc:  # noqa: BLE001 - a crash is a failure of this case only
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return result(FAILED, f"raised {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
    if harness.failures:
        return result(FAILED, "; ".join(harness.failures))
    return result(PASSED)
