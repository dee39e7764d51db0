"""The cmake flags that build llama.cpp for this CPU: each x86 extension ggml has an option for, on
where /proc/cpuinfo lists it, and AMX always off.

ggml's `-march=native` build died in its AMX kernels on an Intel machine of ours, and a build with
`-DGGML_AVX_VNNI=ON` dies with "Illegal instruction" on AMD Zen 4, which has AVX-512 VNNI but not
the VEX-encoded AVX-VNNI. Naming every extension from what the CPU reports avoids both.

    cmake -B build -DCMAKE_BUILD_TYPE=Release $(python bench/llama_cpp_flags.py) ...
"""

from __future__ import annotations

import argparse

from candelabra.backends.torch.cpu.features import cpu_flags, parse_cpu_flags

# ggml's cmake option for each /proc/cpuinfo flag it has a kernel path for
GGML_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}  # fmt: skip
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_flags(flags: frozenset[str]) -> list[str]:
    """`-D` options for a CPU with these /proc/cpuinfo flags."""
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_OPTIONS.items()]
    options += [f"-D{option}=OFF" for option in AMX_OPTIONS]
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpuinfo", help="read the flags from this file instead of /proc/cpuinfo")
    args = parser.parse_args()
    if args.cpuinfo:
        with open(args.cpuinfo, encoding="utf-8") as text:
            flags = parse_cpu_flags(text.read())
    else:
        flags = cpu_flags()
    print(" ".join(cmake_flags(flags)))


if __name__ == "__main__":
    main()
