"""bench/llama_cpp_flags.py: llama.cpp's cmake flags follow the CPU's /proc/cpuinfo, AMX always off."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "bench" / "llama_cpp_flags.py"


def cmake_flags(flags: set[str]) -> list[str]:
    spec = importlib.util.spec_from_file_location("llama_cpp_flags", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cmake_flags(frozenset(flags))


ZEN4 = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
        "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}
ZEN3 = {"avx", "avx2", "fma", "f16c", "bmi2"}


def test_zen4_gets_avx512_vnni_but_not_the_avx_vnni_it_lacks():
    flags = cmake_flags(ZEN4)
    assert "-DGGML_AVX512_VNNI=ON" in flags and "-DGGML_AVX_VNNI=OFF" in flags and "-DGGML_NATIVE=OFF" in flags


def test_amx_stays_off_on_a_cpu_that_has_it():
    flags = cmake_flags(SAPPHIRE_RAPIDS)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DGGML_AVX_VNNI=ON"} <= set(flags)


def test_an_avx2_cpu_gets_no_avx512():
    flags = cmake_flags(ZEN3)
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_AVX512=OFF" in flags and "-DGGML_AVX512_BF16=OFF" in flags
