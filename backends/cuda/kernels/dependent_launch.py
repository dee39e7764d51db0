"""Programmatic dependent launch (compute capability 9.0 on): the backend's Triton kernels start while the
kernel before them finishes, not after it.

A batch-1 decode step of an 8B model is about 290 kernels of 1.5 to 60 µs. Between two of them the GPU
drains the first, launches the second, and the second's programs then wait a DRAM round trip for their first
bytes: the H200 trace of 27 November showed 0.3 to 1 µs between kernels, and each small kernel (norm, rotary,
attention, activation) at 1.5 to 2.5 µs for work of a fraction of that. Launched as a dependent
(`launch_pdl`), a kernel's programs may start once every program of the kernel before it has signalled
(`gdc_launch_dependents`, which ours do first); they then read what no kernel writes (their weights) and
wait (`gdc_wait`) until the kernel before has finished and its writes are visible. Every kernel here
launches so; most wait first thing (`begin`), having nothing to read that the kernel before could not
have written.

Two rules keep that safe; `compile_check` holds the PTX of every dependent variant to both, but for what a
program reads before its wait, which is the code's to say (and the GEMVs' machine code to loading their
first step's weight ahead of the wait, ACQBULK in SASS, which is what they gain):
- before its wait a program reads only what no kernel of the step writes, and writes nothing;
- every program waits, even one with nothing to do: the kernel after trusts that this one finished only
  after the one before it did.

Off below compute capability 9.0 (there is no such launch), under the interpreter, and with
CANDELABRA_PDL=0 (bench/gpu_check.sh's `bench-no-pdl` measures what it gains).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from candelabra.backends.cuda.availability import compute_capability, interpreting

SWITCH = "CANDELABRA_PDL"
FIRST_CAPABILITY = 9


def dependent(device) -> bool:
    """Whether kernels on `device` launch as dependents of the kernel before them."""
    if interpreting() or os.environ.get(SWITCH, "1").strip() == "0":
        return False
    capability = compute_capability(device)
    return capability is not None and capability[0] >= FIRST_CAPABILITY


def launch_options(device) -> dict:
    """The keyword arguments of a launch on `device` of a kernel that takes `DEPENDENT: tl.constexpr` and
    calls `start_dependents` and `wait_for_prior` with it."""
    if dependent(device):
        return {"DEPENDENT": True, "launch_pdl": True}
    return {"DEPENDENT": False}


@triton.jit
def start_dependents(DEPENDENT: tl.constexpr):
    """Let the next kernel's programs launch once every program of this one has got here."""
    if DEPENDENT:
        gdc_launch_dependents()


@triton.jit
def wait_for_prior(DEPENDENT: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible (a no-op not launched so)."""
    if DEPENDENT:
        gdc_wait()


@triton.jit
def begin(DEPENDENT: tl.constexpr):
    """`start_dependents` then `wait_for_prior`: the start of a kernel that reads nothing before its wait."""
    start_dependents(DEPENDENT)
    wait_for_prior(DEPENDENT)
