"""The C kernel library's ISA variants and how each is compiled, ahead of time: by setup.py when the
package is built or installed, never at serve time.

One library per variant, `libcandelabra_cpu_<variant>.so` beside this module: the block products
(block_products.c with the variant's file in arch/) and the decode attention, compiled with the
variant's flags. kernel_library.py picks at load the first variant whose CPU flags this CPU has. The
library is compiled with OpenMP and linked without a runtime: its OpenMP symbols are bound at load to
the runtime torch has loaded, so that its threads are torch's.

Standard library only: setup.py loads this module by path, before torch or the package is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "csrc"
X86 = frozenset({"x86_64", "amd64"})
ARM = frozenset({"aarch64", "arm64"})
BASE_FLAGS = ("-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-std=gnu11")
COMPILE_TIMEOUT_S = 300
# The attention is one sequence's sum in one order whatever its batch, but which of its products GCC fuses
# into FMAs follows how each entry point inlines them: with -mtune=skylake-avx512 a request's tokens parted
# from its tokens alone after six (the engine level's chunked-prefill case, seed 1053860449).
SOURCE_FLAGS = {"decode_attention.c": ("-ffp-contract=off",)}


@dataclass(frozen=True)
class Variant:
    name: str
    machines: frozenset[str]  # platform.machine(), lower case
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags a CPU needs to run it
    compiler_flags: tuple[str, ...]
    arch_source: str  # in csrc/arch/

    @property
    def library_name(self) -> str:
        return f"libcandelabra_cpu_{self.name}.so"


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
# Best first: a CPU runs the first whose flags it has.
VARIANTS = (
    # Tuned for Intel's AVX-512 cores: with generic tuning blocks_float took up to 1.31 times as long at 16 rows
    # of float32 x on an Intel Xeon.
    Variant("avx512", X86, frozenset(_AVX2 + _AVX512),
            ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
             "-mtune=skylake-avx512"), "x86_avx512.c"),
    Variant("avx2", X86, frozenset(_AVX2), ("-mavx2", "-mfma", "-mf16c"), "x86_avx2.c"),
    Variant("portable", X86 | ARM, frozenset(), (), "portable.c"),
)


def machine() -> str:
    return platform.machine().lower()


def variants_for(machine_name: str | None = None) -> tuple[Variant, ...]:
    """The variants built for a machine (this one by default): none off Linux."""
    if platform.system() != "Linux":
        return ()
    name = machine_name or machine()
    return tuple(v for v in VARIANTS if name in v.machines)


def _abi():
    spec = importlib.util.spec_from_file_location("candelabra_kernel_abi", HERE / "kernel_abi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def abi_header() -> str:
    return _abi().header()


def source_files() -> list[Path]:
    """Every file the libraries are compiled from, the ABI table among them."""
    return sorted([*SOURCES.rglob("*.c"), *SOURCES.rglob("*.h"), HERE / "kernel_abi.py", Path(__file__).resolve()])


def sources_digest() -> str:
    """What a library's code depends on, which it carries (`candelabra_kernel_sources`): a library whose
    digest differs from the sources beside it is not loaded."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update((path.relative_to(SOURCES).as_posix() if SOURCES in path.parents else path.name).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:24]


def find_compiler() -> str | None:
    """$CC, else the compiler Python was built with where it is installed, else cc, gcc or clang."""
    names = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    return next((found for name in names if name and (found := shutil.which(name))), None)


def compile_commands(variant: Variant, target: Path, work: Path, compiler: str,
                     extra_flags: Sequence[str] = ()) -> list[list[str]]:
    """Each source to an object in `work` (which holds the written kernel_abi.h), then the objects linked
    into `target`, without an OpenMP runtime."""
    flags = [*BASE_FLAGS, *variant.compiler_flags, *extra_flags, f"-I{work}",
             f'-DCANDELABRA_SOURCES_DIGEST="{sources_digest()}"']
    sources = [SOURCES / "block_products.c", SOURCES / "arch" / variant.arch_source, SOURCES / "decode_attention.c",
               SOURCES / "memory_read.c"]
    objects = [work / f"{source.stem}.o" for source in sources]
    steps = [[compiler, *flags, *SOURCE_FLAGS.get(source.name, ()), "-c", str(source), "-o", str(obj)]
             for source, obj in zip(sources, objects)]
    steps.append([compiler, "-shared", *extra_flags, *map(str, objects), "-lm", "-o", str(target)])
    return steps


def build(variant: Variant, target: Path, compiler: str | None = None, extra_flags: Sequence[str] = ()) -> str | None:
    """`variant` built into `target` (through a temporary file renamed into place); the error, or None."""
    compiler = compiler or find_compiler()
    if compiler is None:
        return "no C compiler found (cc, gcc or clang on PATH, or $CC)"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="candelabra-kernels-") as folder:
        work = Path(folder)
        (work / "kernel_abi.h").write_text(abi_header())
        built = work / target.name
        steps = compile_commands(variant, built, work, compiler, extra_flags)
        try:
            compiles = [_started(step) for step in steps[:-1]]  # the sources compile side by side
            errors = [_finished(process) for process in compiles]
            error = next((e for e in errors if e), None) or _finished(_started(steps[-1]))
        except OSError as exc:
            return f"{compiler} does not run: {exc}"
        if error:
            return error
        os.replace(built, target)
    return None


def _started(step: list[str]) -> subprocess.Popen:
    return subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(process: subprocess.Popen) -> str | None:
    """What went wrong with a compiler run, once it ends, or None."""
    try:
        _, errors = process.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return f"{' '.join(process.args)}: no result in {COMPILE_TIMEOUT_S} s"
    return f"{' '.join(process.args)}: {errors.strip()[-2000:]}" if process.returncode else None


def main() -> int:
    """Builds every variant for this machine beside this module, as the install does: after a change to
    the C sources in a checkout installed with `pip install -e`."""
    failed = 0
    for variant in variants_for():
        error = build(variant, HERE / variant.library_name)
        print(f"{variant.name}: {error or 'built'}")
        failed += error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
