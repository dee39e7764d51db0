"""Quantized weights kept by the torch backend: int4 groups and int8 rows, and the matmuls on them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from candelabra.backends.torch import weight_forms
from candelabra.backends.torch.kernel_table import Choice
from candelabra.backends.torch.quantized import (
    INT4_FORMATS,
    INT8_FORMATS,
    candidates,
    int4_group_size,
    int4_groupwise,
    int8_rowwise,
    keep_quantized,
)
from candelabra.backends.torch.weight_forms import DenseWeight, Int4Weight, Int8Weight
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.weights import GGUF_QUANTIZED_FORMATS, INT4_GROUP_FORMATS, QuantizedTensor

MATMUL_NMSE = 1e-4


def nmse(values: torch.Tensor, reference: np.ndarray) -> float:
    difference = values.double().numpy() - reference
    return float(np.sum(np.square(difference)) / np.sum(np.square(reference)))


def random_x(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16)


def oracle(x: torch.Tensor, weight: np.ndarray) -> np.ndarray:
    return x.double().numpy() @ weight.astype(np.float64).T


@pytest.mark.parametrize("format", sorted(INT4_FORMATS))
def test_int4_groups_rebuild_the_dequantized_weight(format):
    weight = random_quantized(np.random.default_rng(1), format, 48, 512)
    nibbles, scales, zeros = int4_groupwise(weight)
    group = int4_group_size(weight)
    assert group == (32 if format.startswith("Q") else int(format.removeprefix("INT4_G")))
    assert nibbles.dtype == np.uint8 and nibbles.shape == (48, 512) and nibbles.max() <= 15
    assert scales.dtype == zeros.dtype == np.float32 and scales.shape == zeros.shape == (48, 512 // group)
    assert len(np.unique(nibbles)) == 16
    rebuilt = (nibbles.astype(np.float64) - 8) * np.repeat(scales, group, axis=1) + np.repeat(zeros, group, axis=1)
    reference = weight.dequantize().astype(np.float64)
    np.testing.assert_allclose(rebuilt, reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())


def test_int4_groups_refuse_other_formats_by_name():
    weight = random_quantized(np.random.default_rng(2), "Q5_K", 16, 256)
    with pytest.raises(ValueError, match="Q5_K"):
        int4_groupwise(weight)


def test_int8_rows_round_to_the_nearest_step():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, 64)).astype(np.float32) * rng.uniform(0.1, 10, (6, 1)).astype(np.float32)
    values[2] = 0
    quantized, scales = int8_rowwise(values)
    assert quantized.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (6,)
    assert scales[2] == 1 and not quantized[2].any()
    assert np.all(np.abs(quantized).max(axis=1)[[0, 1, 3, 4, 5]] == 127)
    error = np.abs(quantized * scales[:, None].astype(np.float64) - values)
    assert np.all(error <= scales[:, None] * (0.5 + 1e-5))


def kept_forms(rng: np.random.Generator, dtype: torch.dtype = torch.bfloat16):
    """(form, the float64 values it multiplies by) for each form, on random 40 x 512 weights: 40 output
    rows are not whole tiles of 16."""
    q4 = random_quantized(rng, "Q4_K", 40, 512)
    int4 = Int4Weight.from_groups(*int4_groupwise(q4), dtype)
    values, scales = int8_rowwise(random_quantized(rng, "Q8_0", 40, 512).dequantize())
    int8 = Int8Weight.from_rows(values, scales, dtype)
    dense = DenseWeight(torch.from_numpy(random_quantized(rng, "Q5_0", 40, 512).dequantize()).to(dtype))
    return [(form, form.dense().double().numpy()) for form in (int4, int8, dense)]


FORM_KERNELS = [("int4", "int4_mm"), ("int4", "rebuild"), ("int4", "rebuild_f32"), ("int8", "int8_mm"),
                ("int8", "int8_split"), ("int8", "rebuild"), ("int8", "rebuild_f32"), ("dense", "dense"),
                ("dense", "dense_f32")]


def test_each_form_names_the_kernels_these_tests_check():
    named = {(form.form, name) for form, _ in kept_forms(np.random.default_rng(3)) for name in form.kernels()}
    assert named == set(FORM_KERNELS)


# Each kernel of each form at rows from one decode to a prefill chunk; the rebuilding kernels also with
# slices smaller than the weight (several slices, and of the int8 products several column slices).
SMALL_SLICES = {"INT4_SLICE_ELEMENTS": 512 * 7, "SCRATCH_ELEMENTS": 512 * 7, "SLICE_ELEMENTS": 512 * 7,
                "PRODUCT_SLICE_ELEMENTS": 40 * 16}


@pytest.mark.parametrize("form_name, kernel", FORM_KERNELS)
@pytest.mark.parametrize("rows, slices", [(1, {}), (3, {}), (17, {}), (130, {}), (40, SMALL_SLICES)])
def test_every_kernel_matches_the_float64_product_of_its_forms_values(form_name, kernel, rows, slices, monkeypatch):
    for name, value in slices.items():
        monkeypatch.setattr(weight_forms, name, value)
    rng = np.random.default_rng(4)
    form, values = next((f, v) for f, v in kept_forms(rng) if f.form == form_name)
    x = random_x(rng, rows, 512)
    out = form.kernels()[kernel](x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    assert nmse(out, oracle(x, values)) < MATMUL_NMSE


# int8 rows are kept in bfloat16 only (quantized.INT8_COMPUTE_DTYPES)
@pytest.mark.parametrize("form_name, kernel", [("int4", "int4_mm"), ("int4", "rebuild"), ("dense", "dense")])
def test_kernels_in_float32_are_exact_to_float32_rounding(form_name, kernel):
    rng = np.random.default_rng(15)
    form, values = next((f, v) for f, v in kept_forms(rng, torch.float32) if f.form == form_name)
    assert set(form.kernels()) == {"int4_mm", "rebuild"} if form_name == "int4" else {"dense"}
    x = torch.from_numpy(rng.standard_normal((5, 512))).float()
    assert nmse(form.kernels()[kernel](x), oracle(x, values)) < 1e-10


def test_a_form_multiplies_by_the_kernel_its_choice_names_for_the_rows():
    form, _ = kept_forms(np.random.default_rng(16))[1]
    called = []
    kernels = form.kernels()
    form.kernels = lambda: {name: (lambda x, name=name: called.append(name) or kernels[name](x)) for name in kernels}
    form.choice = Choice("int8", ("int8_mm", "int8_split", "int8_split", "rebuild", "rebuild_f32"))
    for rows in (1, 2, 5, 16, 40, 64, 300):
        form.matmul(random_x(np.random.default_rng(rows), rows, 512))
    assert called == ["int8_mm", "int8_mm", "int8_split", "int8_split", "rebuild", "rebuild", "rebuild_f32"]


def test_int8_activations_keep_small_values_beside_outliers():
    """Qwen's activations have a few channels 100 times the rest: one int8 step per row would round
    most values to nothing; the second part keeps them, to about bfloat16's own precision."""
    rng = np.random.default_rng(13)
    weight = rng.standard_normal((48, 512)).astype(np.float32)
    kept = Int8Weight.from_rows(*int8_rowwise(weight), torch.bfloat16)
    x = rng.standard_normal((8, 512))
    x[:, [3, 200]] *= 300
    x = torch.from_numpy(x).to(torch.bfloat16)
    as_kept = (kept.values.double() * kept.scales.double()[:, None]).numpy()
    reference = oracle(x, as_kept)
    split = nmse(kept.kernels()["int8_split"](x), reference)
    bfloat16_rounding = nmse(torch.from_numpy(reference).to(torch.bfloat16), reference)
    assert split < 2 * bfloat16_rounding
    step = x.double().abs().amax(1, keepdim=True) / 127
    first_part_only = torch.round(x.double() / step) * step
    assert nmse(first_part_only @ torch.from_numpy(as_kept).T, reference) > 100 * split


@pytest.mark.parametrize("format", ["Q4_1", "Q4_K", "Q5_0", "Q6_K"])
def test_rows_are_the_dense_weights_rows(format):
    kept = keep_quantized(random_quantized(np.random.default_rng(14), format, 40, 256), torch.bfloat16)
    ids = torch.tensor([[39, 0, 7], [7, 7, 21]])
    rows = kept.rows(ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 3, 256)
    assert torch.equal(rows, kept.dense()[ids])


@pytest.mark.parametrize("format", ["Q4_K", "Q6_K"])
def test_matmul_keeps_leading_dims(format):
    rng = np.random.default_rng(6)
    weight = random_quantized(rng, format, 32, 256)
    kept = keep_quantized(weight, torch.bfloat16)
    x = random_x(rng, 2, 5, 256)
    out = kept.matmul(x)
    assert out.shape == (2, 5, 32)
    np.testing.assert_array_equal(out.reshape(10, 32).float().numpy(), kept.matmul(x.reshape(10, 256)).float().numpy())


def test_sizes_count_what_is_kept():
    rng = np.random.default_rng(7)
    int4 = keep_quantized(random_quantized(rng, "Q4_0", 32, 256), torch.bfloat16)
    int8 = keep_quantized(random_quantized(rng, "Q8_0", 32, 256), torch.bfloat16)
    assert int4.shape == int8.shape == (32, 256)
    assert int4.nbytes == 2 * (32 * 256 // 2) + 256 // 32 * 32 * 2 * 2  # torch's layout and the row-order pairs
    assert int8.nbytes == 32 * 256 + 32 * 2


# Grouped int4 weights (GPTQ, AWQ): groups of their own size, columns possibly stored permuted


def act_ordered(rng: np.random.Generator, format: str, rows: int, columns: int) -> QuantizedTensor:
    """A random weight of `format` whose columns are stored in a random order, as act-order GPTQ's are."""
    weight = random_quantized(rng, format, rows, columns)
    return QuantizedTensor(format, weight.blocks, weight.shape, rng.permutation(columns))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format", sorted(INT4_GROUP_FORMATS))
def test_a_grouped_int4_weight_keeps_its_group_size_and_every_kernel_multiplies_its_values(format, dtype):
    rng = np.random.default_rng(22)
    weight = random_quantized(rng, format, 40, 512)
    kept = keep_quantized(weight, dtype)
    assert isinstance(kept, Int4Weight) and kept.group_size == INT4_GROUP_FORMATS[format]
    assert kept.scales_and_zeros.shape == (512 // kept.group_size, 48, 2)  # 40 rows padded to whole tiles
    values = weight.dequantize()
    np.testing.assert_allclose(kept.dense(dtype=torch.float32).numpy(), values, rtol=1e-2 if dtype != torch.float32
                               else 1e-6, atol=1e-2 * np.abs(values).max())
    x = torch.from_numpy(rng.standard_normal((3, 512))).to(dtype)
    for name, kernel in kept.kernels().items():
        assert nmse(kernel(x), oracle(x, kept.dense().double().numpy())) < MATMUL_NMSE, name


@pytest.mark.parametrize("rows", [1, 17])
def test_an_act_ordered_weight_multiplies_x_in_its_own_column_order(rows):
    rng = np.random.default_rng(23)
    weight = act_ordered(rng, "INT4_G64", 40, 512)
    kept = keep_quantized(weight, torch.float32)
    np.testing.assert_allclose(kept.dense().numpy(), weight.dequantize(), rtol=1e-6, atol=1e-6)
    x = torch.from_numpy(rng.standard_normal((rows, 512))).float()
    reference = oracle(x, weight.dequantize())
    for name, kernel in kept.kernels().items():
        assert nmse(kernel(x), reference) < 1e-10, name
    ids = torch.tensor([3, 39, 3])
    assert torch.equal(kept.rows(ids), kept.dense()[ids])


def test_a_grouped_int4_weights_scales_take_less_memory_in_larger_groups():
    rng = np.random.default_rng(24)
    sizes = [keep_quantized(random_quantized(rng, format, 32, 512), torch.bfloat16).nbytes
             for format in ("INT4_G32", "INT4_G128")]
    assert sizes == [2 * 32 * 256 + 16 * 32 * 4, 2 * 32 * 256 + 4 * 32 * 4]


def test_int8_refuses_widths_its_kernel_cannot_read():
    with pytest.raises(ValueError, match="16"):
        Int8Weight(torch.ones(4, 24, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("format", [*GGUF_QUANTIZED_FORMATS, *INT4_GROUP_FORMATS])
def test_without_a_selector_a_weight_is_kept_in_its_first_candidate_form(format):
    weight = random_quantized(np.random.default_rng(8), format, 16, 256)
    kept = keep_quantized(weight, torch.bfloat16)
    expected = Int4Weight if format in INT4_FORMATS else Int8Weight if format in INT8_FORMATS else type(None)
    assert type(kept) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("format", ["Q4_0", "Q4_K", "Q8_0", "Q6_K", "INT4_G128"])
def test_outside_bfloat16_only_exact_forms_are_candidates(format, dtype):
    forms = [c.form for c in candidates(random_quantized(np.random.default_rng(9), format, 16, 256), dtype)]
    expected = {"Q4_0": ["int4", "blocks", "dense"], "Q4_K": ["int4", "blocks", "dense"],
                "INT4_G128": ["int4", "dense"]}
    assert forms == expected.get(format, ["blocks", "dense"])


def test_an_embedding_table_is_never_packed_since_its_rows_are_read_back():
    weight = random_quantized(np.random.default_rng(10), "Q8_0", 32, 256)
    assert [c.form for c in candidates(weight, torch.bfloat16)] == ["int8", "int8_packed", "blocks", "dense"]
    assert [c.form for c in candidates(weight, torch.bfloat16, readable=True)] == ["blocks", "int8", "dense"]


def test_a_weight_too_outlying_for_int8_rows_is_never_kept_as_int8_rows():
    rng = np.random.default_rng(17)
    dense = rng.standard_normal((32, 256)).astype(np.float32)
    dense[:, 7] = 30  # one column that takes each row's whole int8 range: NMSE about 1e-3
    weight = QuantizedTensor("Q8_0", gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0), (32, 256))
    assert [c.form for c in candidates(weight, torch.bfloat16)] == ["blocks", "dense"]


@pytest.mark.parametrize("form_name", ["int4", "int8"])
def test_a_rebuild_runs_outside_inference_mode_after_one_inside_it(form_name):
    """A server's steps run under inference mode and its embeddings' forwards do not; the scratch
    buffer the first made must take the second's writes (it answered 500 for 64 tokens)."""
    import threading

    form, values = next((f, v) for f, v in kept_forms(np.random.default_rng(18)) if f.form == form_name)
    x = random_x(np.random.default_rng(19), 70, 512)
    outputs, errors = [], []

    def in_a_fresh_thread():  # the scratch buffer is per thread: this one has none yet
        try:
            with torch.inference_mode():
                outputs.append(form.kernels()["rebuild"](x))
            outputs.append(form.kernels()["rebuild"](x))
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert not errors and len(outputs) == 2
    assert nmse(outputs[1], oracle(x, values)) < MATMUL_NMSE


# A MoE layer's experts


def quantized_experts(rng, format, experts, rows, columns):
    return QuantizedTensor.stack([random_quantized(rng, format, rows, columns) for _ in range(experts)])


@pytest.mark.parametrize("format", ["Q4_0", "Q6_K", "INT4_G128"])
def test_quantized_experts_are_kept_one_form_per_expert_and_multiply_as_their_values(format):
    from candelabra.backends.torch.backend import TorchBackend
    from candelabra.backends.torch.expert_weights import ExpertWeights
    from candelabra.conformance.oracle import moe_experts
    from candelabra.core.contract.weights import WeightRole

    rng = np.random.default_rng(20)
    backend = TorchBackend()
    gate_up, down = quantized_experts(rng, format, 4, 512, 256), quantized_experts(rng, format, 4, 256, 256)
    kept_gate_up = backend.upload_weight("experts.gate_up_proj", WeightRole.EXPERTS, gate_up, "float32")
    kept_down = backend.upload_weight("experts.down_proj", WeightRole.EXPERTS, down, "float32")
    assert isinstance(kept_gate_up, ExpertWeights) and kept_gate_up.shape == (4, 512, 256)
    assert all(isinstance(expert, weight_forms.KeptWeight) for expert in (*kept_gate_up.experts, *kept_down.experts))
    x = rng.standard_normal((6, 256)).astype(np.float32)
    ids = np.array([[0, 2], [2, 3], [3, 0], [2, 0], [0, 3], [3, 2]], dtype=np.int32)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    out = backend.ops.moe_experts(torch.from_numpy(x), torch.from_numpy(weights), torch.from_numpy(ids),
                                  kept_gate_up, kept_down)
    assert nmse(out, moe_experts(x, weights, ids, gate_up.dequantize(), down.dequantize())) < 1e-10


def test_experts_a_placement_keeps_dense_are_one_3d_tensor_of_their_values():
    """On a device's placement no CPU kernel keeps a quantized form: the experts come back as one tensor."""
    from candelabra.backends.torch.backend import TorchBackend
    from candelabra.backends.torch.placement import DevicePlacement
    from candelabra.core.contract.weights import WeightRole

    backend = TorchBackend()
    backend.placement = DevicePlacement(backend.torch_device, "gloo")
    experts = quantized_experts(np.random.default_rng(21), "Q4_K", 3, 64, 256)
    kept = backend.upload_weight("experts.down_proj", WeightRole.EXPERTS, experts, "float32")
    assert isinstance(kept, torch.Tensor) and kept.shape == (3, 64, 256)
    np.testing.assert_array_equal(kept.numpy(), experts.dequantize())
