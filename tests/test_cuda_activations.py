"""The cuda backend's activation kernels, on the GPU or through the Triton interpreter, against the float64
oracle."""

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.kernels.activations import gelu, gelu_and_mul, silu_and_mul
from candelabra.conformance import oracle
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

# exp(-x) and exp(2z) overflow to inf for large |x| by design (the formulas take the right limit);
# the interpreter's numpy says so.
pytestmark = [skip_where_the_kernels_cannot_run(),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]

DEVICE = kernel_device()
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# rtol, and atol as a fraction of the reference's largest magnitude (gelu's tail, 1 + tanh(z) for
# z near -inf, cancels in float32 in every implementation, torch's included).
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-3, 1e-5)}
# Leading shape and I: one row, a multi-block I that is no multiple of the block, odd sizes, I = 1.
GATED_SHAPES = [((1,), 896), ((37,), 1024), ((9, 8), 64), ((3,), 2560), ((4,), 640), ((2,), 80), ((5,), 1)]


def random_tensor(rng, shape, dtype, scale=3.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(DEVICE, DTYPES[dtype])


def assert_close(out: torch.Tensor, reference: np.ndarray, dtype: str) -> None:
    assert out.dtype == DTYPES[dtype] and tuple(out.shape) == reference.shape
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(float64_values(out), reference, rtol=rtol, atol=atol * np.abs(reference).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading, inner", GATED_SHAPES)
def test_silu_and_mul_matches_the_oracle(leading, inner, dtype):
    x = random_tensor(np.random.default_rng(inner), (*leading, 2 * inner), dtype)
    x_before = x.clone()

    out = silu_and_mul(x)

    assert_close(out, oracle.silu_and_mul(float64_values(x)), dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("leading, inner", [((1,), 896), ((9, 8), 64), ((3,), 2560), ((2,), 80), ((5,), 1)])
def test_gelu_and_mul_matches_the_oracle(leading, inner, approximate, dtype):
    x = random_tensor(np.random.default_rng(inner + 1), (*leading, 2 * inner), dtype)

    out = gelu_and_mul(x, approximate)

    assert_close(out, oracle.gelu_and_mul(float64_values(x), approximate), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1, 896), (3, 1027), (9, 8, 80), (1,)])
def test_gelu_matches_the_oracle(shape, approximate, dtype):
    x = random_tensor(np.random.default_rng(sum(shape)), shape, dtype)

    out = gelu(x, approximate)

    assert_close(out, oracle.gelu(float64_values(x), approximate), dtype)


def test_the_two_gelu_forms_differ_where_they_should():
    # A kernel that ignored `approximate` would pass each form's test only by luck of tolerance:
    # at x = -2 the forms differ by about 0.2%, far above float32's tolerance.
    x = torch.full((4,), -2.0, device=DEVICE)
    exact, tanh_form = gelu(x, "none"), gelu(x, "tanh")
    assert_close(exact, oracle.gelu(float64_values(x), "none"), "float32")
    assert_close(tanh_form, oracle.gelu(float64_values(x), "tanh"), "float32")
    assert not torch.equal(exact, tanh_form)


def test_extreme_inputs_stay_finite():
    x = torch.tensor([-1e4, -90.0, -20.0, 0.0, 20.0, 90.0, 1e4], dtype=torch.float32, device=DEVICE)
    gated = torch.cat([x, torch.ones_like(x)])
    for out, reference in (
        (silu_and_mul(gated), oracle.silu_and_mul(float64_values(gated))),
        (gelu(x, "tanh"), oracle.gelu(float64_values(x), "tanh")),
        (gelu(x, "none"), oracle.gelu(float64_values(x), "none")),
    ):
        assert torch.isfinite(out).all()
        assert_close(out, reference, "float32")


def test_rows_with_a_stride_wider_than_the_input():
    rng = np.random.default_rng(5)
    wide = random_tensor(rng, (6, 3 * 160), "float32")
    x = wide[:, 160:480]  # a view whose rows are 480 apart

    assert_close(silu_and_mul(x), oracle.silu_and_mul(float64_values(x)), "float32")


def test_empty_inputs_and_bad_arguments():
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    assert gelu(torch.empty(0, 8, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.ones(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="approximation"):
        gelu(torch.ones(3, device=DEVICE), "sigmoid")
    with pytest.raises(ValueError, match="approximation"):
        gelu_and_mul(torch.ones(2, 4, device=DEVICE), "exact")
