"""Fused projections whose parts are stored in different formats (RowStack): joined, sharded and padded as
their dense values would be, kept part by part on the torch backend, and dequantized for any backend that
does not keep them."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from candelabra.backends.cpu.backend import CpuBackend
from candelabra.backends.torch.backend import TorchBackend
from candelabra.backends.torch.row_stack import RowStackWeight
from candelabra.conformance.model_cases import GGUF_MIXED_CASE, _gguf_reference
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.weights import QuantizedTensor, RowStack, WeightRole
from candelabra.core.loading.model import load_model
from candelabra.core.models.sharding import pad_rows, take_columns, take_rows
from candelabra.core.weights.gguf import GGUFCheckpoint

RNG = np.random.default_rng(0)


def quantized(format: str, rows: int, columns: int = 64) -> QuantizedTensor:
    values = RNG.standard_normal((rows, columns)).astype(np.float32)
    return QuantizedTensor(format, quantize(values, GGMLQuantizationType[format]), (rows, columns))


def test_neighbours_of_one_format_are_joined_and_one_format_alone_is_no_stack():
    q, k, v = quantized("Q5_0", 8), quantized("Q5_0", 4), quantized("Q8_0", 4)

    stack = RowStack.of([q, k, v])
    single = RowStack.of([q, k])

    assert isinstance(stack, RowStack) and stack.formats == ("Q5_0", "Q8_0") and stack.shape == (16, 64)
    assert isinstance(single, QuantizedTensor) and single.format == "Q5_0" and single.shape == (12, 64)
    assert np.array_equal(stack.dequantize(), np.concatenate([q.dequantize(), k.dequantize(), v.dequantize()]))


def test_parts_that_cannot_stand_side_by_side_are_refused():
    with pytest.raises(ValueError, match="one width"):
        RowStack.of([quantized("Q5_0", 4), quantized("Q8_0", 4, columns=96)])
    with pytest.raises(ValueError, match="differ in format"):
        RowStack((quantized("Q8_0", 4), quantized("Q8_0", 4)))
    with pytest.raises(ValueError, match="none"):
        RowStack.of([])
    shuffled = QuantizedTensor("Q8_0", quantized("Q8_0", 4).blocks, (4, 64), RNG.permutation(64))
    with pytest.raises(ValueError, match="orders"):
        RowStack.of([quantized("Q5_0", 4), shuffled])


@pytest.mark.parametrize("ranges", [[range(0, 16)], [range(2, 6), range(9, 11), range(13, 16)], [range(10, 13)]])
def test_rows_taken_across_parts_are_the_dense_rows_and_keep_their_formats(ranges):
    stack = RowStack.of([quantized("Q5_0", 8), quantized("Q8_0", 4), quantized("Q4_0", 4)])

    taken = take_rows(stack, ranges)

    assert np.array_equal(taken.dequantize(), np.concatenate([stack.dequantize()[r.start:r.stop] for r in ranges]))
    formats = taken.formats if isinstance(taken, RowStack) else (taken.format,)
    assert set(formats) <= {"Q5_0", "Q8_0", "Q4_0"}


def test_padding_and_columns_of_a_stack():
    stack = RowStack.of([quantized("Q5_0", 8), quantized("Q8_0", 4)])

    padded = pad_rows(stack, 15)
    on_blocks = take_columns(stack, range(32, 64))
    off_blocks = take_columns(stack, range(10, 50))

    assert isinstance(padded, RowStack) and padded.shape == (15, 64)
    assert np.array_equal(padded.dequantize(), np.concatenate([stack.dequantize(), np.zeros((3, 64), np.float32)]))
    assert isinstance(on_blocks, RowStack) and np.array_equal(on_blocks.dequantize(), stack.dequantize()[:, 32:64])
    assert isinstance(off_blocks, np.ndarray) and np.array_equal(off_blocks, stack.dequantize()[:, 10:50])


def test_a_backend_that_keeps_dense_weights_only_refuses_a_stack_naming_its_formats():
    with pytest.raises(TypeError, match="Q5_0 and Q8_0 blocks"):
        Backend.upload_weight(CpuBackend(), "qkv.weight", WeightRole.LINEAR,
                              RowStack.of([quantized("Q5_0", 4), quantized("Q8_0", 4)]), "float32")


def kept_projections(model) -> list:
    return [weight for layer in model.layers for weight in (layer.qkv, layer.mlp_in)]


def test_a_mixed_quantization_reaches_the_torch_backend_part_by_part_and_the_numpy_one_dense(tmp_path):
    reference, path = _gguf_reference(GGUF_MIXED_CASE, seed=3, folder=str(tmp_path))
    x = torch.from_numpy(RNG.standard_normal((3, reference.config.hidden_size)).astype(np.float32))

    with GGUFCheckpoint(path) as checkpoint:
        on_torch = kept_projections(load_model(checkpoint, TorchBackend(), "float32"))
        on_numpy = kept_projections(load_model(checkpoint, CpuBackend(), "float32"))

    assert all(isinstance(weight, RowStackWeight) for weight in on_torch)
    assert all(isinstance(weight, np.ndarray) for weight in on_numpy)
    for stack, dense in zip(on_torch, on_numpy):
        assert stack.shape == dense.shape
        expected = F.linear(x.double(), torch.from_numpy(dense).double())
        assert torch.allclose(stack.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_a_stack_whose_every_part_comes_back_dense_is_one_tensor(monkeypatch):
    backend = TorchBackend()
    monkeypatch.setattr(backend, "upload_quantized",
                        lambda name, weight, dtype, role=None: torch.from_numpy(weight.dequantize()))
    stack = RowStack.of([quantized("Q5_0", 8), quantized("Q8_0", 4)])

    kept = backend.upload_weight("qkv.weight", WeightRole.LINEAR, stack, "float32")

    assert isinstance(kept, torch.Tensor) and torch.equal(kept, torch.from_numpy(stack.dequantize()))
