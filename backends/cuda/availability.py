"""Whether the cuda backend can run here, and on what: a CUDA device, or CPU tensors through the
Triton interpreter (TRITON_INTERPRET=1), which runs every kernel slowly but exactly, for tests."""

from __future__ import annotations

import importlib.util
import os

INTERPRETER_VARIABLE = "TRITON_INTERPRET"


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
