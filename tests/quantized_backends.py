"""Test backends around quantized weights: the numpy backend recording what `upload_weight`
receives, one that keeps every GGUF format candelabra reads (and one the grouped int4 formats as
well), one that also rounds activations as fast kernels do, and one with a quantized kernel bug.

`QuantizedCpuBackend.linear` (and `moe_experts`, whose experts it keeps quantized too) multiplies
by a `QuantizedTensor`'s dequantized values on every call: slow, but an honest kernel for the
formats it declares.
"""

import numpy as np

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.cpu.ops import NumpyOps
from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QUANTIZED_FORMATS, QuantizedTensor, WeightRole


class RecordingCpuBackend(CpuBackend):
    """The numpy backend, with `uploads`: what upload_weight received, by (name, role)."""

    name = "cpu-recording"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.uploads = {}

    def upload_weight(self, name, role, weight, dtype):
        self.uploads[name, role] = weight
        return weight if isinstance(weight, QuantizedTensor) else super().upload_weight(name, role, weight, dtype)


class _DequantizingOps(NumpyOps):
    backend_name = "cpu-quantized"

    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedTensor):
            weight = weight.dequantize()
        return super().linear(x, weight, bias)

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        gate_up, down = (w.dequantize() if isinstance(w, QuantizedTensor) else w for w in (gate_up, down))
        return super().moe_experts(x, weights, expert_ids, gate_up, down, first_expert)


class QuantizedCpuBackend(RecordingCpuBackend):
    name = "cpu-quantized"
    quantized_formats = frozenset(QUANTIZED_FORMATS)
    quantized_roles = QUANTIZABLE_ROLES | {WeightRole.EXPERTS}
    ops_class = _DequantizingOps

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops = self.ops_class()


class _RoundsActivations(_DequantizingOps):
    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedTensor):
            block = 256 if weight.format.endswith("_K") else 32
            blocks = x.reshape(*x.shape[:-1], -1, block)
            scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127
            scale = np.where(scale == 0, 1, scale)
            x = (np.round(blocks / scale) * scale).reshape(x.shape).astype(x.dtype)
        return super().linear(x, weight, bias)


class QuantizedRoundsActivations(QuantizedCpuBackend):
    """Rounds x to 8-bit integers per block along K before a quantized product, as llama.cpp's
    CPU kernels do (Q8_0 blocks of 32, Q8_K blocks of 256): what the linear docstring allows."""

    name = "cpu-quantized-int8"
    ops_class = _RoundsActivations

    def activation_rounding(self):
        return "int8"


class _SwapsHalves(_DequantizingOps):
    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedTensor):
            values = weight.dequantize()
            weight = values.reshape(values.shape[0], -1, 2, 16)[:, :, ::-1].reshape(values.shape)
        return super().linear(x, weight, bias)


class _RoundsAndSwapsHalves(_RoundsActivations, _SwapsHalves):
    """x rounded (_RoundsActivations), then multiplied by the halves-swapped values (_SwapsHalves)."""


class RoundsActivationsSwapsHalves(QuantizedRoundsActivations):
    """Rounds activations, as it says, and reads each block's two halves of 16 values in the wrong order."""

    ops_class = _RoundsAndSwapsHalves


class RoundsActivationsUnsaid(QuantizedRoundsActivations):
    """The same kernels, without saying that they round activations."""

    def activation_rounding(self):
        return None


class _DropsBiasOnQuantized(_DequantizingOps):
    def linear(self, x, weight, bias=None):
        return super().linear(x, weight, None if isinstance(weight, QuantizedTensor) else bias)


class QuantizedLinearDropsBias(QuantizedCpuBackend):
    """Forgets the bias when the weight is quantized, as a kernel written for bias-free layers would."""

    name = "broken-quantized-bias"
    ops_class = _DropsBiasOnQuantized
