"""Programmatic dependent launch (backends/cuda/kernels/dependent_launch.py): where the kernels launch as
dependents, and the compile check's hold on the rule that a dependent program waits for the kernel before it
ahead of any write (the kernels themselves are compiled so in test_cuda_compile.py)."""

import os
import subprocess
import sys

import pytest
import torch

from candelabra.backends.cuda.availability import assume_capability
from candelabra.backends.cuda.compile_check import Compiled, dependent_fault
from candelabra.backends.cuda.kernels.dependent_launch import SWITCH, dependent, launch_options

CPU = torch.device("cpu")


def test_kernels_launch_as_dependents_from_compute_capability_9_unless_interpreted_or_switched_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(SWITCH, raising=False)
    assert not dependent(CPU)  # CPU tensors have no compute capability
    with assume_capability(9, 0):
        assert dependent(CPU)
        assert launch_options(CPU) == {"DEPENDENT": True, "launch_pdl": True}
        monkeypatch.setenv(SWITCH, "0")
        assert launch_options(CPU) == {"DEPENDENT": False}
        monkeypatch.setenv(SWITCH, "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not dependent(CPU)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    with assume_capability(10, 0):
        assert dependent(CPU)
    with assume_capability(8, 9):
        assert launch_options(CPU) == {"DEPENDENT": False}


PTX_HEAD = """
.visible .entry k(.param .u64 k_param_0)
{
\tld.param.u64 \t%rd1, [k_param_0];
\tgriddepcontrol.launch_dependents; // dummy %r1
\tld.global.v4.b32 \t{ %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ];
"""


@pytest.mark.parametrize(("body", "fault"), [
    ("\tgriddepcontrol.wait; // dummy %r6\n\t@%p1 st.global.b16 \t[ %rd2 + 0 ], { %rs1 };\n\tret;\n}", None),
    ("\t@%p1 st.global.b16 \t[ %rd2 + 0 ], { %rs1 };\n\tgriddepcontrol.wait; // dummy %r6\n\tret;\n}",
     "writes or ends before it waits for it (st.global.b16)"),
    ("\tatom.global.gpu.acq_rel.add.u32 \t%r7, [%rd3], 1;\n\tgriddepcontrol.wait; // dummy %r6\n\tret;\n}",
     "writes or ends before it waits for it (atom.global.gpu.acq_rel.add.u32)"),
    ("\t@%p2 bra \t$L__BB0_2;\n\tret;\n$L__BB0_2:\n\tgriddepcontrol.wait; // dummy %r6\n\tret;\n}",
     "writes or ends before it waits for it (ret)"),
    ("\t@%p1 st.global.b16 \t[ %rd2 + 0 ], { %rs1 };\n\tret;\n}", "never waits for it"),
])
def test_a_dependent_variant_must_wait_before_it_writes_or_ends(body, fault):
    assert dependent_fault(PTX_HEAD + body) == fault


def test_a_variant_that_breaks_the_rules_fails_the_check():
    broken = Compiled("_rms_norm_kernel", "DEPENDENT=True", "sm_90a", registers=32, spilled=0, shared=0,
                      dependent_fault="never waits for it")
    assert broken.problems == ["is launched as a dependent of the kernel before it but never waits for it"]


# Two kernels compiled for sm_90a as the backend's launch code would launch them there: one that stores
# before it waits, one that waits first. Triton must keep the order written, or the check sees it.
KERNELS = '''
import torch
import triton
import triton.language as tl
from candelabra.backends.cuda import compile_check as cc
from candelabra.backends.cuda.kernels.dependent_launch import begin, launch_options, start_dependents, wait_for_prior

@triton.jit
def store_then_wait(x_ptr, out_ptr, DEPENDENT: tl.constexpr):
    start_dependents(DEPENDENT)
    tl.store(out_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32))
    wait_for_prior(DEPENDENT)
    tl.store(out_ptr + 16 + tl.arange(0, 16), tl.load(x_ptr + tl.arange(0, 16)))

@triton.jit
def wait_then_store(x_ptr, out_ptr, DEPENDENT: tl.constexpr):
    begin(DEPENDENT)
    tl.store(out_ptr + tl.arange(0, 16), tl.load(x_ptr + tl.arange(0, 16)))

target = cc.TARGETS["sm_90a"]
x = torch.empty(32)
with cc.recording_launches(target) as launches:
    for kernel in (store_then_wait, wait_then_store):
        kernel[(1,)](x, x, **launch_options(x.device))
for launch in launches:
    print(launch.name, cc.compile_launch(launch, cc.specialization(launch, target), target).dependent_fault)
'''


@pytest.mark.slow
def test_the_compile_check_finds_a_kernel_that_writes_before_it_waits(tmp_path):
    script = tmp_path / "kernels.py"
    script.write_text(KERNELS)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [
        "store_then_wait writes or ends before it waits for it (st.global.b32)",
        "wait_then_store None",
    ]
