"""The GGUF block kernels touch no byte outside their buffers: each ISA variant this CPU runs, built as the
install builds it (kernel_build.py) but with AddressSanitizer, is called by a C driver on every entry point over
every format, kernel, dtype and a spread of row counts. A one-row product once read past x and wrote past y
on AVX-512 builds, corrupting the heap only some of the time."""

import os
import subprocess

import pytest

from candelabra.backends.torch.cpu import kernel_build, kernel_library
from support import REPO

ASAN = ("-fsanitize=address", "-fno-omit-frame-pointer")


@pytest.mark.parametrize("variant", [v.name for v in kernel_build.VARIANTS])
def test_every_block_kernel_stays_inside_its_buffers(tmp_path, variant):
    compiler = kernel_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    chosen = next((v for v in kernel_library.runnable_variants() if v.name == variant), None)
    if chosen is None:
        pytest.skip(f"this CPU or machine does not run the {variant} kernels")
    if not _builds_with_asan(compiler, tmp_path):
        pytest.skip(f"{compiler} cannot build with AddressSanitizer here")
    (tmp_path / "kernel_abi.h").write_text(kernel_build.abi_header())
    steps = kernel_build.compile_commands(chosen, tmp_path / "unused.so", tmp_path, compiler, ASAN)
    objects = [step[-1] for step in steps[:2]]  # block_products.c and the variant's arch file
    for step in steps[:2]:
        compiled = subprocess.run(step, capture_output=True, text=True, timeout=300)
        assert compiled.returncode == 0, compiled.stderr[-3000:]
    built = tmp_path / "driver"
    driver = REPO / "tests" / "gguf_blocks_memory_driver.c"
    link = [compiler, *ASAN, "-fopenmp", f"-I{tmp_path}", str(driver), *objects, "-lm", "-o", str(built)]
    linked = subprocess.run(link, capture_output=True, text=True, timeout=300)
    assert linked.returncode == 0, linked.stderr[-3000:]
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
