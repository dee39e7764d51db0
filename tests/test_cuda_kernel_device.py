"""Where the cuda kernel tests run the kernels: on the GPU where torch sees one, else on CPU tensors
through Triton's interpreter, chosen once before collection (tests/conftest.py), unless whoever runs
the tests set TRITON_INTERPRET."""

import os

import torch
from triton.runtime.interpreter import InterpretedFunction

from candelabra.backends.cuda.availability import INTERPRETER_VARIABLE, cuda_missing, interpreting
from candelabra.backends.cuda.backend import CudaBackend
from candelabra.backends.cuda.kernels import norms
from support import interpret_the_kernels_without_a_gpu, kernel_device


def test_triton_interprets_the_kernels_exactly_when_the_tests_place_their_tensors_on_the_cpu():
    # Triton chose when it decorated the kernel, at its module's import: a choice made later misses it
    assert isinstance(norms._rms_norm_kernel, InterpretedFunction) == interpreting()
    assert kernel_device().type == CudaBackend.device_type == ("cpu" if interpreting() else "cuda")


def test_the_interpreter_is_chosen_only_where_torch_sees_no_gpu(monkeypatch):
    monkeypatch.delenv(INTERPRETER_VARIABLE, raising=False)
    interpret_the_kernels_without_a_gpu()
    assert interpreting() == (cuda_missing(torch) is not None)


def test_a_setting_made_by_whoever_runs_the_tests_is_kept(monkeypatch):
    monkeypatch.setenv(INTERPRETER_VARIABLE, "0")
    interpret_the_kernels_without_a_gpu()
    assert os.environ[INTERPRETER_VARIABLE] == "0"
