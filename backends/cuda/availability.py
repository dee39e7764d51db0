"""Whether the cuda backend can run here, and on what: a CUDA device, or CPU tensors through the
Triton interpreter (TRITON_INTERPRET=1), which runs every kernel slowly but exactly, for tests."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

INTERPRETER_VARIABLE = "TRITON_INTERPRET"
# What launch code run for a GPU that is not here (compile_check) takes that GPU to be, by property:
# "multiprocessors" (its SM count), "gpu" (its model; "" for none with a measured table), "capability".
_assumed: dict[str, object] = {}
# What launch code on CPU tensors (the interpreter) plans for: an H100 SXM's SMs, so that the grids it
# tests are the ones a GPU gets.
NOMINAL_MULTIPROCESSORS = 132


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors, in numpy."""
    return os.environ.get(INTERPRETER_VARIABLE, "0").strip() == "1"


def triton_missing() -> str | None:
    """Why Triton cannot be imported, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install 'candelabra[cuda]'"
    return None


def interpreter_broken() -> str | None:
    """Why the Triton interpreter cannot run our kernels here, or None. Triton 3.6's interpreter takes
    int() of one-element arrays for every loop bound computed at run time, which numpy 2.4 refuses."""
    import numpy
    import triton

    if _version(numpy.__version__) >= (2, 4) and _version(triton.__version__) < (3, 7):
        return (f"the Triton {triton.__version__} interpreter cannot run with numpy {numpy.__version__} "
                f"(int() of a one-element array); pip install 'numpy<2.4'")
    return None


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def cuda_missing(torch) -> str | None:
    """Why `torch` has no CUDA device to run on, or None."""
    if torch.version.cuda is None:
        return (f"torch has no CUDA (torch {torch.__version__} is a CPU build); install a CUDA build of torch, "
                f"or set {INTERPRETER_VARIABLE}=1 to run the kernels on CPU tensors for testing")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return f"no CUDA device{seen} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


def multiprocessor_count(device) -> int:
    """SMs of the CUDA `device` that launch code sizes its grids for: the device's own, the count
    `assume_multiprocessors` names, or NOMINAL_MULTIPROCESSORS for CPU tensors."""
    return _property(device, "multiprocessors", lambda found: found.multi_processor_count, NOMINAL_MULTIPROCESSORS)


def gpu_name(device) -> str | None:
    """The model of the CUDA `device` (torch.cuda.get_device_name's), the one `assume_gpu` names, or None for
    CPU tensors: what the measured kernel tables are looked up by."""
    return _property(device, "gpu", lambda found: found.name, None) or None


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of the CUDA `device`, the one `assume_capability` names, or None for CPU tensors."""
    return _property(device, "capability", lambda found: (found.major, found.minor), None)


def assume_multiprocessors(count: int) -> contextlib.AbstractContextManager[None]:
    """Launch code inside plans its grids for a GPU of `count` SMs, whatever the tensors' device."""
    return _assuming("multiprocessors", count)


def assume_gpu(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Launch code inside looks up measured tables as on a GPU of model `name` (None: none measured),
    whatever the tensors' device."""
    return _assuming("gpu", name or "")


def assume_capability(major: int, minor: int) -> contextlib.AbstractContextManager[None]:
    """Launch code inside launches as for a GPU of compute capability major.minor, whatever the tensors' device."""
    return _assuming("capability", (major, minor))


def _property(device, what: str, read, on_cpu):
    if what in _assumed:
        return _assumed[what]
    if device.type != "cuda":
        return on_cpu
    return read(_device_properties(device.index if device.index is not None else 0))


@functools.cache
def _device_properties(index: int):
    import torch

    return torch.cuda.get_device_properties(index)


@contextlib.contextmanager
def _assuming(what: str, value) -> Iterator[None]:
    missing = object()
    previous = _assumed.get(what, missing)
    _assumed[what] = value
    try:
        yield
    finally:
        if previous is missing:
            del _assumed[what]
        else:
            _assumed[what] = previous
