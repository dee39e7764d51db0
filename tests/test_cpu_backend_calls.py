"""The numpy reference backend's calls besides the ops, and the base Ops refusing every op until a
backend overrides it."""

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.core.contract.ops import OP_NAMES, OpNotSupported, Ops


def test_cpu_backend_memory_calls():
    backend = CpuBackend()
    host = np.arange(6, dtype=np.float64).reshape(2, 3)
    device = backend.to_device(host)
    host[0, 0] = 99  # the device copy does not alias the caller's array
    assert backend.to_host(device).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert backend.dtype_of(device) == "float32"
    assert backend.dtype_of(backend.to_device(np.array([1, 2], np.int32))) == "int32"
    assert backend.free_memory() > 0
    backend.synchronize()
    with pytest.raises(ValueError, match="does not compute in bfloat16; it offers float32"):
        backend.to_device(host, "bfloat16")
    with pytest.raises(TypeError, match="cannot move an array of dtype"):
        backend.to_device(np.array(["a"]))


def test_every_op_raises_op_not_supported_until_overridden():
    ops = Ops()
    assert not any(ops.supports(op) for op in OP_NAMES)
    with pytest.raises(OpNotSupported, match="backend 'unnamed' does not support softmax"):
        ops.softmax(np.zeros(3))
    assert all(CpuBackend().ops.supports(op) for op in OP_NAMES)
    with pytest.raises(ValueError, match="unknown op 'matmul'"):
        ops.supports("matmul")
