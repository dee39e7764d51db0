"""The GGUF block kernels touch no byte outside their buffers: built as the torch backend builds them
(-O3 -march=native, OpenMP) but with AddressSanitizer, a C driver calls every entry point over every
format, kernel, dtype and a spread of row counts. A one-row product once read past x and wrote past y
on AVX-512 builds, corrupting the heap only some of the time."""

import os
import subprocess

import pytest

from candelabra.backends.torch.cpu.kernel_library import OPTIMIZE_FLAGS, find_compiler
from support import REPO


def test_every_block_kernel_stays_inside_its_buffers(tmp_path):
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    built = tmp_path / "driver"
    sources = [str(REPO / "tests" / "gguf_blocks_memory_driver.c"), str(REPO / "backends/torch/cpu/csrc/block_products.c")]
    flags = [flag for flag in OPTIMIZE_FLAGS if flag != "-fPIC"]
    compiled = subprocess.run([compiler, *flags, "-fopenmp", "-fsanitize=address", "-fno-omit-frame-pointer",
                               *sources, "-lm", "-o", str(built)], capture_output=True, text=True, timeout=300)
    if compiled.returncode and not _builds_with_asan(compiler, tmp_path):
        pytest.skip(f"{compiler} cannot build with AddressSanitizer here: {compiled.stderr[-300:]}")
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    ran = subprocess.run([str(built)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert ran.returncode == 0 and "all ran" in ran.stdout, (ran.stdout + ran.stderr)[-3000:]


def _builds_with_asan(compiler: str, folder) -> bool:
    """Whether `compiler` builds and links an empty program with AddressSanitizer (its runtime may be missing)."""
    source = folder / "empty.c"
    source.write_text("int main(void) { return 0; }\n")
    done = subprocess.run([compiler, "-fsanitize=address", str(source), "-o", str(folder / "empty")],
                          capture_output=True, timeout=120)
    return done.returncode == 0
