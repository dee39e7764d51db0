"""The cuda backend's RMS norm kernels, on the GPU or through the Triton interpreter, against the float64
oracle."""

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.kernels.norms import add_rms_norm, rms_norm
from candelabra.conformance import oracle
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
DTYPES = {"float32": (torch.float32, np.float32), "float16": (torch.float16, np.float16)}
# rtol, and atol as a fraction of the reference's largest magnitude.
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-3, 1e-5)}
SHAPES = [(1, 896), (37, 2048), (9, 8, 128), (3, 2560), (4, 640), (2, 80), (5, 1)]


def random_tensor(rng, shape, dtype, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(DEVICE, DTYPES[dtype][0])


def assert_close(out: torch.Tensor, reference: np.ndarray, dtype: str) -> None:
    assert out.dtype == DTYPES[dtype][0] and tuple(out.shape) == reference.shape
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(float64_values(out), reference, rtol=rtol, atol=atol * np.abs(reference).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_the_oracle(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = random_tensor(rng, shape, dtype, scale=2.0)
    weight = random_tensor(rng, shape[-1], dtype)
    x_before = x.clone()

    out = rms_norm(x, weight, 1e-6)

    assert_close(out, oracle.rms_norm(float64_values(x), float64_values(weight), 1e-6), dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_weight_offset_and_a_large_eps(dtype):
    rng = np.random.default_rng(7)
    x = random_tensor(rng, (6, 640), dtype, scale=0.01)  # small enough that eps matters
    weight = random_tensor(rng, 640, dtype, scale=0.1)

    out = rms_norm(x, weight, 1e-3, weight_offset=1.0)

    assert_close(out, oracle.rms_norm(float64_values(x), float64_values(weight), 1e-3, 1.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 896), (37, 2048), (9, 8, 128), (3, 2560), (5, 1)])
def test_add_rms_norm_normalises_the_sum_rounded_to_the_input_dtype(shape, dtype):
    rng = np.random.default_rng(100 + sum(shape))
    x, residual = random_tensor(rng, shape, dtype, 3.0), random_tensor(rng, shape, dtype, 3.0)
    weight = random_tensor(rng, shape[-1], dtype)
    offset = 1.0 if shape[-1] == 128 else 0.0
    inputs_before = x.clone(), residual.clone()

    normed, summed = add_rms_norm(x, residual, weight, 1e-5, offset)

    numpy_dtype = DTYPES[dtype][1]
    expected_normed, expected_sum = oracle.add_rms_norm(
        float64_values(x), float64_values(residual), float64_values(weight), 1e-5, offset,
        round_sum=lambda s: s.astype(numpy_dtype),
    )
    assert summed.dtype == x.dtype and np.array_equal(float64_values(summed), expected_sum)
    assert_close(normed, expected_normed, dtype)
    assert torch.equal(x, inputs_before[0]) and torch.equal(residual, inputs_before[1])


def test_rows_with_a_stride_wider_than_the_hidden_size():
    rng = np.random.default_rng(11)
    wide = random_tensor(rng, (7, 3 * 80), "float32")
    x, residual = wide[:, 80:160], wide[:, :80]  # views into one fused projection
    weight = random_tensor(rng, 80, "float32")

    normed, summed = add_rms_norm(x, residual, weight, 1e-6)

    expected_normed, expected_sum = oracle.add_rms_norm(
        float64_values(x), float64_values(residual), float64_values(weight), 1e-6,
        round_sum=lambda s: s.astype(np.float32),
    )
    assert np.array_equal(float64_values(summed), expected_sum)
    assert_close(normed, expected_normed, "float32")
    expected_alone = oracle.rms_norm(float64_values(x), float64_values(weight), 1e-6)
    assert_close(rms_norm(x, weight, 1e-6), expected_alone, "float32")


def test_float32_weight_with_float16_activations():
    rng = np.random.default_rng(12)
    x, weight = random_tensor(rng, (4, 896), "float16"), random_tensor(rng, 896, "float32")

    out = rms_norm(x, weight, 1e-6)

    assert_close(out, oracle.rms_norm(float64_values(x), float64_values(weight), 1e-6), "float16")


def test_no_rows_gives_an_empty_result():
    weight = torch.ones(64, device=DEVICE)
    no_rows = torch.empty(0, 64, device=DEVICE)
    normed, summed = add_rms_norm(no_rows, no_rows, weight, 1e-6)
    assert normed.shape == summed.shape == (0, 64)
    assert rms_norm(no_rows, weight, 1e-6).shape == (0, 64)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.ones(2, 64, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.ones(2, 64, device=DEVICE), torch.ones(2, 32, device=DEVICE), torch.ones(64, device=DEVICE),
                     1e-6)
