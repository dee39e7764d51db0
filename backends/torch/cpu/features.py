"""What the host CPU offers torch: native bfloat16 arithmetic, and how many cores this process may use."""

from __future__ import annotations

import os
import platform
from functools import cache

# CPU flags (Linux /proc/cpuinfo) that give bfloat16 dot products in hardware: x86's AVX-512 BF16 and
# AMX, Arm's BF16 extension.
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU listed in the text of /proc/cpuinfo (x86 "flags", Arm "Features")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; empty where there is no /proc/cpuinfo (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return parse_cpu_flags(cpuinfo.read())
    except OSError:
        return frozenset()


def parse_cpu_model_name(cpuinfo: str) -> str:
    """The first CPU's model name in the text of /proc/cpuinfo (x86 "model name", some Arm "Model")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model"):
            return value.strip()
    return ""


@cache
def cpu_model_name() -> str:
    """This machine's CPU model, as lscpu names it, else what the platform module says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            name = parse_cpu_model_name(cpuinfo.read())
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def has_native_bfloat16(flags: frozenset[str] | None = None) -> bool:
    """Whether bfloat16 matmuls run in hardware (given `flags`, else this machine's); elsewhere
    torch emulates them, slower than float32."""
    if flags is None and platform.system() == "Darwin" and platform.machine() == "arm64":
        return True  # Apple M2 and later; torch's CPU kernels use it where present
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BFLOAT16_FLAGS)


def default_dtypes(native_bfloat16: bool) -> tuple[str, ...]:
    """The compute dtypes a torch CPU backend offers, its default first: bfloat16 halves the bytes every
    weight and activation moves, but only pays where the CPU computes it in hardware."""
    return ("bfloat16", "float32", "float16") if native_bfloat16 else ("float32", "bfloat16", "float16")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def take_share_of_cores(index: int, shares: int) -> None:
    """Run the calling thread, and the threads it starts (torch's OpenMP team), on share `index` of
    `shares` equal shares of the cores it may use: tensor-parallel ranks on one CPU then each keep
    cores of their own instead of all of them contending for all. No-op where the OS has no affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    per_share = max(1, len(cores) // shares)
    start = (index * per_share) % len(cores)
    os.sched_setaffinity(0, cores[start:start + per_share])
