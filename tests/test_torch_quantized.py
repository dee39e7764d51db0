"""GGUF quantized weights kept by the torch backend: int4 groups and int8 rows, and the matmuls on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from candelabra.backends.torch import quantized
from candelabra.backends.torch.quantized import (
    INT4_FORMATS,
    INT8_FORMATS,
    Int4Weight,
    Int8Weight,
    int4_groupwise,
    int8_rowwise,
    keep_quantized,
)
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.weights import GGUF_QUANTIZED_FORMATS

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
    assert nibbles.dtype == np.uint8 and nibbles.shape == (48, 512) and nibbles.max() <= 15
    assert scales.dtype == zeros.dtype == np.float32 and scales.shape == zeros.shape == (48, 16)
    assert len(np.unique(nibbles)) == 16
    rebuilt = (nibbles.astype(np.float64) - 8) * np.repeat(scales, 32, axis=1) + np.repeat(zeros, 32, axis=1)
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


# An int4 weight: 1 to 17 rows through the weight-only kernel, 130 through a dense rebuild, in one
# slice or (a smaller slice size) in several.
@pytest.mark.parametrize("format", sorted(INT4_FORMATS))
@pytest.mark.parametrize("rows, slice_elements", [(1, None), (3, None), (17, None), (130, None), (130, 512 * 7)])
def test_int4_matmul_matches_the_float64_oracle(format, rows, slice_elements, monkeypatch):
    if slice_elements:
        monkeypatch.setattr(quantized, "INT4_SLICE_ELEMENTS", slice_elements)
    rng = np.random.default_rng(4)
    weight = random_quantized(rng, format, 40, 512)  # 40 output rows: not whole tiles of 16
    kept = Int4Weight.from_groups(*int4_groupwise(weight), torch.bfloat16)
    x = random_x(rng, rows, 512)
    out = kept.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    assert nmse(out, oracle(x, weight.dequantize())) < MATMUL_NMSE


# An int8 weight: 1 and 3 rows through the weight-only kernel; 8, 17 and 40 through x split into int8
# parts, its products in one slice of columns or (a smaller slice size) in several; 70 through dense
# slices, in one or, with a scratch buffer smaller than the weight, in several.
INT8_PATHS = [(1, {}), (3, {}), (8, {}), (17, {}), (40, {"PRODUCT_SLICE_ELEMENTS": 40 * 16}),
              (70, {}), (70, {"SCRATCH_ELEMENTS": 512 * 7, "SLICE_ELEMENTS": 512 * 7})]


@pytest.mark.parametrize("rows, settings", INT8_PATHS)
def test_int8_matmul_matches_the_float64_oracle(rows, settings, monkeypatch):
    for name, value in settings.items():
        monkeypatch.setattr(quantized, name, value)
    rng = np.random.default_rng(5)
    weight = random_quantized(rng, "Q8_0", 40, 512).dequantize()
    kept = Int8Weight.from_rows(*int8_rowwise(weight), torch.bfloat16)
    x = random_x(rng, rows, 512)
    out = kept.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    assert nmse(out, oracle(x, weight)) < MATMUL_NMSE


def test_int8_activations_keep_small_values_beside_outliers():
    """Qwen's activations have a few channels 100 times the rest: one int8 step per row would round
    most values to nothing; the second part keeps them, to about bfloat16's own precision."""
    rng = np.random.default_rng(13)
    weight = rng.standard_normal((48, 512)).astype(np.float32)
    kept = Int8Weight.from_rows(*int8_rowwise(weight), torch.bfloat16)
    x = rng.standard_normal((quantized.INT8_ACTIVATIONS_FROM_ROWS, 512))
    x[:, [3, 200]] *= 300
    x = torch.from_numpy(x).to(torch.bfloat16)
    as_kept = (kept.values.double() * kept.scales.double()[:, None]).numpy()
    reference = oracle(x, as_kept)
    split = nmse(kept.matmul(x), reference)
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


def test_int8_refuses_widths_its_kernel_cannot_read():
    with pytest.raises(ValueError, match="16"):
        Int8Weight(torch.ones(4, 24, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("format", GGUF_QUANTIZED_FORMATS)
def test_keep_quantized_chooses_by_format_in_bfloat16(format):
    weight = random_quantized(np.random.default_rng(8), format, 16, 256)
    kept = keep_quantized(weight, torch.bfloat16)
    expected = Int4Weight if format in INT4_FORMATS else Int8Weight if format in INT8_FORMATS else type(None)
    assert type(kept) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("format", ["Q4_0", "Q4_K", "Q8_0", "Q6_K"])
def test_keep_quantized_leaves_slow_dtypes_to_a_dense_copy(format, dtype):
    assert keep_quantized(random_quantized(np.random.default_rng(9), format, 16, 256), dtype) is None


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_dense_copy_is_the_weight_with_bfloat16_scales(format):
    rng = np.random.default_rng(11)
    weight = random_quantized(rng, format, 40, 512)
    kept = keep_quantized(weight, torch.bfloat16)
    nibbles, scales, zeros = int4_groupwise(weight)
    as_kept = lambda v: torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    expected = ((nibbles.astype(np.float32) - 8).reshape(40, -1, 32) * as_kept(scales)[..., None]
                + as_kept(zeros)[..., None]).reshape(40, 512)
    assert np.allclose(kept.dense().float().numpy(), expected, rtol=1e-2, atol=1e-6)
    assert nmse(kept.dense(), weight.dequantize()) < 1e-5


@pytest.mark.parametrize("format", ["Q4_K", "Q5_0"])
def test_a_dense_copy_holds_the_kept_values_and_serves_batches(format):
    rng = np.random.default_rng(12)
    weight = random_quantized(rng, format, 40, 512)
    kept = keep_quantized(weight, torch.bfloat16, dense_copy=True)
    assert torch.equal(kept.dense_copy, kept.dense())
    assert keep_quantized(weight, torch.bfloat16).dense_copy is None
    x = random_x(rng, quantized.DENSE_COPY_FROM_ROWS, 512)
    assert nmse(kept.matmul(x), oracle(x, weight.dequantize())) < MATMUL_NMSE
