"""The C kernel library for this CPU, built ahead of time (kernel_build.py), loaded with ctypes.

The first ISA variant this CPU has the flags for (kernel_build.VARIANTS, best first) whose library was
built is loaded, its entry points typed from kernel_abi.py. Its OpenMP symbols bind to the runtime
torch has loaded, made global first, so that its threads are torch's: a second runtime's spinning
workers would compete with torch's for the same cores. A library built from other sources than those
beside it is not loaded. Where none loads, `kernels()` says why, and the torch backend serves on
torch's own ops.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from candelabra.backends.torch.cpu import kernel_abi, kernel_build
from candelabra.backends.torch.cpu.features import cpu_flags

REBUILD = "python -m candelabra.backends.torch.cpu.kernel_build"


@dataclass(frozen=True)
class Kernels:
    """The loaded library, or why there is none."""

    library: ctypes.CDLL | None
    variant: str | None
    detail: str  # what was loaded ("avx2+fma, openmp (avx2): <path>"), or why nothing was


_PREFERRED: list[str | None] = [None]


def kernels(variant: str | None = None) -> Kernels:
    """The library of `variant`, else of the variant `prefer` named, else of the best variant this CPU runs;
    never raises."""
    return _loaded(variant or _PREFERRED[0])


def prefer(variant: str | None) -> None:
    """Make `variant` (None: the best this CPU runs) the one `kernels()` loads in this process, for a benchmark
    that measures a smaller ISA's kernels on a larger CPU."""
    _PREFERRED[0] = variant


def forget() -> None:
    """Load afresh at the next call, as a new process would."""
    _loaded.cache_clear()


def runnable_variants() -> list[kernel_build.Variant]:
    """The variants built for this machine whose CPU flags this CPU has, best first."""
    flags = cpu_flags()
    return [v for v in kernel_build.variants_for() if v.cpu_flags <= flags]


def library_path(variant: kernel_build.Variant) -> Path:
    return kernel_build.HERE / variant.library_name


@cache
def _loaded(variant: str | None) -> Kernels:
    built = kernel_build.variants_for()
    if not built:
        return Kernels(None, None, f"no C kernels for {platform.system()} on {kernel_build.machine()}: "
                                   "Linux on x86-64 or aarch64 only")
    runnable = runnable_variants()
    if variant is not None:
        if variant not in {v.name for v in built}:
            return Kernels(None, variant, f"no kernel variant {variant!r}: {', '.join(v.name for v in built)}")
        runnable = [v for v in runnable if v.name == variant]
        if not runnable:
            return Kernels(None, variant, f"this CPU lacks flags the {variant} kernels need")
    reasons = []
    for candidate in runnable:
        loaded, reason = _load(candidate)
        if loaded is not None:
            return loaded
        reasons.append(reason)
    return Kernels(None, variant, "; ".join(reasons) + (f"; `{REBUILD}` builds them" if reasons else ""))


def _load(variant: kernel_build.Variant) -> tuple[Kernels | None, str]:
    path = library_path(variant)
    if not path.exists():
        return None, f"the {variant.name} kernels were not built with this install (was there a C compiler?)"
    loaded = load_file(path, variant.name)
    return (loaded, "") if loaded.library is not None else (None, loaded.detail)


def load_file(path: Path, variant: str) -> Kernels:
    """The library at `path`, built by kernel_build from the sources beside this module (a benchmark builds
    variants with extra flags this way), typed and bound to torch's OpenMP runtime; never raises."""
    import torch  # noqa: F401 - its OpenMP runtime, found among the files it maps

    runtime = torch_openmp_library()
    if runtime is None:
        return Kernels(None, variant, "torch has no OpenMP runtime loaded in this process for the kernels' threads")
    try:
        ctypes.CDLL(runtime, mode=ctypes.RTLD_GLOBAL)  # the kernels' OpenMP symbols bind to torch's runtime
        library = kernel_abi.bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        return Kernels(None, variant, f"{path} does not load: {exc}")
    built_from, here = library.candelabra_kernel_sources().decode(), kernel_build.sources_digest()
    if built_from != here:
        return Kernels(None, variant,
                       f"{path} was built from other sources than those beside it ({built_from}, not {here})")
    described = f"{library.gguf_blocks_describe().decode()}; {library.decode_attention_describe().decode()}"
    return Kernels(library, variant, f"{described} ({variant}): {path}")


def torch_openmp_library() -> str | None:
    """The OpenMP runtime torch's CPU library is bound to in this process (its bundled libgomp, a
    system one, or Intel's), found by resolving omp_get_max_threads through it; None where torch
    has none. Other packages may map runtimes of their own (sentencepiece bundles a libgomp)."""
    mapped = _mapped_files()
    torch_cpu = next((path for _, _, path in mapped if os.path.basename(path).startswith("libtorch_cpu.")), None)
    if torch_cpu is None:
        return None
    return library_of_symbol(torch_cpu, "omp_get_max_threads")


def library_of_symbol(library: str | None, symbol: str) -> str | None:
    """The file that `symbol` resolves to, looked up from the loaded `library` and its dependencies, or with
    None in the process's global scope, where a library's undefined symbols are looked up."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(library), symbol), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return next((os.path.realpath(path) for start, end, path in _mapped_files() if start <= address < end), None)


def openmp_runtimes() -> list[str]:
    """Distinct OpenMP runtime files mapped into this process."""
    pattern = re.compile(r"lib(?:g|i|i5)?omp[^/]*\.so")
    return list(dict.fromkeys(os.path.realpath(p) for _, _, p in _mapped_files() if pattern.match(os.path.basename(p))))


def _mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapping in this process (Linux /proc/self/maps), else none."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mapped = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mapped.append((start, end, fields[5]))
    return mapped


