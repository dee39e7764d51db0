"""C kernel libraries compiled on first use with the system C compiler, and loaded with ctypes.

A library is compiled (`-O3 -march=native`) into the cache directory's native/ the first time a process
asks for it, under a name made from the source, the compiler, the flags, this CPU's flags and the
OpenMP runtime it links, so another CPU or a changed source builds afresh and a second start loads
what the first built. It is linked against the OpenMP runtime torch has loaded, so that its threads
are torch's: a second runtime's spinning workers would compete with torch's for the same cores.
Where it cannot be built (no compiler, a compile error, an unsupported platform) the `Build` says
why, and nothing raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from candelabra.backends.torch.cpu.features import cpu_flags

log = logging.getLogger("candelabra")

# Machines whose C compilers take -march=native and where the kernels have been built (x86-64 with or
# without AVX2; aarch64 runs the portable C).
SUPPORTED_MACHINES = frozenset({"x86_64", "amd64", "aarch64", "arm64"})
OPTIMIZE_FLAGS = ("-O3", "-march=native", "-fPIC")
BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class Build:
    """The compiled library, or why there is none."""

    library: ctypes.CDLL | None
    detail: str  # what was loaded ("avx2+fma, openmp: <path>"), or why it could not be built


def built_or_reason(build: Callable[[], Build]) -> Build:
    """`build()`, with whatever stops it turned into the reason there is no library."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - whatever stops the build is a reason, never an error
        return Build(None, f"the kernel library could not be built: {type(exc).__name__}: {exc}")


class NativeLibrary:
    """A C source built on first use in a process (loaded from the cache where an earlier start built it),
    its functions typed by `bind`, described by `describe` (which names the code the build took)."""

    def __init__(self, source: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL],
                 describe: Callable[[ctypes.CDLL], str]) -> None:
        self.source, self._bind, self._describe = source, bind, describe
        self._loaded: Build | None = None

    def loaded(self) -> Build:
        """The library for this process, built on the first call; never raises."""
        if self._loaded is None:
            self._loaded = built_or_reason(self.build)
        return self._loaded

    def available(self) -> tuple[bool, str]:
        """Whether the library is built and loaded here, and what it is or why not."""
        build = self.loaded()
        return build.library is not None, build.detail

    def forget(self) -> None:
        """Build (or find) the library again at the next call, as a new process would."""
        self._loaded = None

    def build(self, extra_flags: tuple[str, ...] = (), folder: Path | None = None) -> Build:
        """The library built with `extra_flags` too (a variant, kept apart by its name), into `folder`."""
        return build_library(self.source, self._bind, self._describe, extra_flags, folder)


def build_library(source: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL], describe: Callable[[ctypes.CDLL], str],
                  extra_flags: tuple[str, ...] = (), folder: Path | None = None) -> Build:
    """`source` built with OpenMP, else without (one thread), typed by `bind` and described by `describe`;
    each build kept in `folder` (the cache directory's native/), and a failed one remembered there, so that a
    later start does not retry it."""
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in SUPPORTED_MACHINES:
        return Build(None, f"no kernel library for {platform.system()} on {machine}: Linux on x86-64 or aarch64 only")
    compiler = find_compiler()
    if compiler is None:
        return Build(None, "no C compiler found (cc, gcc or clang on PATH, or $CC)")
    identity = _compiler_identity(compiler)
    if identity is None:
        return Build(None, f"the C compiler {compiler} does not run")
    openmp, folder = torch_openmp_library(), folder or _cache_folder()
    errors = []
    for flags in ((*OPTIMIZE_FLAGS, "-fopenmp", *extra_flags), (*OPTIMIZE_FLAGS, *extra_flags)):
        runtime = openmp if "-fopenmp" in flags else None
        target = folder / f"{source.stem}-{_key(source, identity, flags, runtime)}.so"
        failed = target.with_suffix(".failed")
        if failed.exists():
            errors.append(failed.read_text())
            continue
        library = _load(target, bind)
        if library is None:
            error = _compile(source, compiler, flags, runtime, target)
            if error:
                errors.append(error)
                failed.write_text(error)
                continue
            library = _load(target, bind)
        if library is not None:
            return Build(library, f"{describe(library)}: {target}")
    return Build(None, f"the kernel library did not compile: {errors[0]}")


def _load(path: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL]) -> ctypes.CDLL | None:
    """The library at `path` with its functions typed; None where it is missing or does not load."""
    try:
        return bind(ctypes.CDLL(str(path)))
    except OSError:
        return None


def find_compiler() -> str | None:
    """The C compiler: $CC, else the one Python was built with where it is installed, else cc, gcc or clang."""
    names = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    for name in names:
        if name and (found := shutil.which(name)):
            return found
    return None


def _compiler_identity(compiler: str) -> str | None:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return f"{compiler} {lines[0]}" if done.returncode == 0 and lines else None


def torch_openmp_library() -> str | None:
    """The OpenMP runtime torch's CPU library is bound to in this process (its bundled libgomp, a
    system one, or Intel's), found by resolving omp_get_max_threads through it; None where torch
    has none. Other packages may map runtimes of their own (sentencepiece bundles a libgomp)."""
    mapped = _mapped_files()
    torch_cpu = next((path for _, _, path in mapped if os.path.basename(path).startswith("libtorch_cpu.")), None)
    if torch_cpu is None:
        return None
    return library_of_symbol(torch_cpu, "omp_get_max_threads")


def library_of_symbol(library: str, symbol: str) -> str | None:
    """The file that `symbol` resolves to, looked up from the loaded `library` and its dependencies."""
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


def _key(source: Path, identity: str, flags: tuple[str, ...], openmp: str | None) -> str:
    """What the built file depends on: the source, the compiler, the flags, the CPU and the runtime linked."""
    parts = [source.read_bytes(), identity.encode(), " ".join(flags).encode(), platform.machine().encode(),
             " ".join(sorted(cpu_flags())).encode(), (openmp or "").encode()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:20]


def _cache_folder() -> Path:
    from candelabra.core.weights.default_model import default_cache_dir

    return default_cache_dir() / "native"


def _compile(source: Path, compiler: str, flags: tuple[str, ...], openmp: str | None, target: Path) -> str | None:
    """Builds `target` (through a temporary file, renamed into place); returns the error, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        built = Path(work) / target.name
        if openmp:
            # compiled with -fopenmp, linked against torch's runtime file itself rather than the system's
            steps = [[compiler, *flags, "-c", str(source), "-o", f"{built}.o"],
                     [compiler, "-shared", f"{built}.o", openmp, f"-Wl,-rpath,{Path(openmp).parent}", "-lm",
                      "-o", str(built)]]
        else:
            steps = [[compiler, *flags, "-shared", str(source), "-lm", "-o", str(built)]]
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                return f"{' '.join(step)}: {exc}"
            if done.returncode != 0:
                return f"{' '.join(step)}: {done.stderr.strip()[-2000:]}"
        os.replace(built, target)
    log.info("built %s (%s) in %.1f s: %s", source.name, " ".join(flags), time.perf_counter() - started, target)
    return None
