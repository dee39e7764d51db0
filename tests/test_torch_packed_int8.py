"""int8 weights packed for oneDNN: x split into two int8 parts, products scaled and added per row."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from candelabra.backends.torch import packed_int8
from candelabra.backends.torch.packed_int8 import PackedInt8Weight, onednn_int8_available, onednn_int8_problem
from candelabra.backends.torch.quantized import candidates, int8_rowwise
from candelabra.backends.torch.weight_forms import split_into_int8_parts
from candelabra.conformance.quantized_weights import random_quantized

needs_onednn = pytest.mark.skipif(not onednn_int8_available(), reason=str(onednn_int8_problem()))


def nmse(values: torch.Tensor, reference: np.ndarray) -> float:
    return float(np.sum(np.square(values.double().numpy() - reference)) / np.sum(np.square(reference)))


def kept_and_values(rng, rows: int, columns: int) -> tuple[PackedInt8Weight, np.ndarray]:
    """A packed weight and its values as kept (int8 times the bfloat16-rounded row scale), in float64."""
    values, scales = int8_rowwise(rng.standard_normal((rows, columns)).astype(np.float32))
    rounded = torch.from_numpy(scales).to(torch.bfloat16)
    weight = PackedInt8Weight(torch.from_numpy(values), rounded, torch.bfloat16)
    return weight, values.astype(np.float64) * rounded.double().numpy()[:, None]


def bfloat16_rounding(reference: np.ndarray) -> float:
    return nmse(torch.from_numpy(reference).to(torch.bfloat16), reference)


# 300 rows in calls of at most 2 * 300 * 40 products: several calls; slices of 16 output rows: three.
@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("settings", [{}, {"PRODUCT_ELEMENTS": 2 * 40 * 50, "SLICE_ROWS": 16}])
def test_matmul_matches_the_float64_product_of_the_kept_values(rows, settings, monkeypatch):
    for name, value in settings.items():
        monkeypatch.setattr(packed_int8, name, value)
    rng = np.random.default_rng(21)
    weight, kept = kept_and_values(rng, 40, 64)
    assert len(weight.slices) == (3 if settings else 1)
    x = torch.from_numpy(rng.standard_normal((rows, 64))).to(torch.bfloat16)
    out = weight.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    reference = x.double().numpy() @ kept.T
    assert nmse(out, reference) < 2 * bfloat16_rounding(reference)


@needs_onednn
def test_leading_dims_are_kept():
    weight, _ = kept_and_values(np.random.default_rng(22), 32, 64)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    assert torch.equal(weight.matmul(x).reshape(10, 32), weight.matmul(x.reshape(10, 64)))


@needs_onednn
def test_outlying_activations_keep_their_small_neighbours():
    rng = np.random.default_rng(23)
    weight, kept = kept_and_values(rng, 48, 512)
    x = rng.standard_normal((4, 512))
    x[:, [3, 200]] *= 300
    x = torch.from_numpy(x).to(torch.bfloat16)
    reference = x.double().numpy() @ kept.T
    assert nmse(weight.matmul(x), reference) < 2 * bfloat16_rounding(reference)


def test_two_parts_carry_x_to_within_a_64516th_of_each_rows_largest_value():
    x = torch.from_numpy(np.random.default_rng(24).standard_normal((6, 256)).astype(np.float32))
    x[2] = 0
    x[4, 7] = 1e4
    parts, scales = split_into_int8_parts(x.clone())
    assert parts.dtype == torch.int8 and parts.shape == (12, 256) and scales.shape == (12, 1)
    rebuilt = parts[:6].double() * scales[:6].double() + parts[6:].double() * scales[6:].double()
    largest = x.double().abs().amax(dim=1, keepdim=True)
    assert torch.all((rebuilt - x.double()).abs() <= largest / 64516 * (1 + 1e-3))


@needs_onednn
def test_a_packed_candidate_multiplies_as_its_unpacked_values_say():
    weight = random_quantized(np.random.default_rng(25), "Q8_0", 32, 256)
    packed = next(c for c in candidates(weight, torch.bfloat16) if c.form == "int8_packed")
    values, scales = int8_rowwise(weight.dequantize())
    kept = values.astype(np.float64) * torch.from_numpy(scales).to(torch.bfloat16).double().numpy()[:, None]
    # what the candidate hands kernel choice as its values: the kept ones, each rounded to bfloat16
    assert np.array_equal(packed.values().double().numpy(), torch.from_numpy(kept).to(torch.bfloat16).double().numpy())
    x = torch.from_numpy(np.random.default_rng(26).standard_normal((5, 256))).to(torch.bfloat16)
    reference = x.double().numpy() @ kept.T
    assert nmse(packed.build().matmul(x), reference) < 2 * bfloat16_rounding(reference)


def test_the_primitive_cache_is_capped_unless_the_user_sized_it(monkeypatch):
    variable = packed_int8.PRIMITIVE_CACHE_VARIABLE
    monkeypatch.delenv(variable, raising=False)
    packed_int8.limit_primitive_cache()
    assert os.environ[variable] == str(packed_int8.PRIMITIVE_CACHE_CAPACITY)
    monkeypatch.setenv(variable, "300")
    packed_int8.limit_primitive_cache()
    assert os.environ[variable] == "300"
