"""The conformance suite's comparison helpers: NMSE refuses non-finite values and mismatched shapes,
rounding to bfloat16 is to nearest even, and a few one-ulp rounding flips are forgiven."""

import math

import numpy as np
import pytest

from candelabra.conformance.compare import ROUNDING_FLIP_SHARE, nmse, nmse_beside_rounding_flips, round_to, ulps_apart


def test_nmse_fails_on_nan_infinity_and_shape_mismatches():
    ref = np.array([1.0, -2.0, 3.0])
    assert nmse(ref, ref) == 0
    assert nmse(ref + [0, 0, 0.03], ref) == pytest.approx(0.03**2 / 14)
    assert nmse(np.array([1.0, np.nan, 3.0]), ref) == math.inf
    assert nmse(np.array([1.0, np.inf, 3.0]), ref) == math.inf
    assert nmse(np.array([-np.inf, 1.0]), np.array([np.inf, 1.0])) == math.inf
    assert nmse(np.array([np.inf, 1.0]), np.array([np.inf, 1.0])) == 0
    assert nmse(ref[:2], ref) == math.inf


def test_round_to_bfloat16_rounds_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, 3.14159265, -2.5e-3], dtype=np.float32)
    rounded = round_to(values, "bfloat16")
    # bfloat16 keeps 8 significant bits: steps of 2**-7 just above 1
    assert rounded.tolist()[:3] == [1.0, 1.0, 1.015625]
    assert rounded[3] == pytest.approx(3.140625)
    assert np.all(np.abs(rounded - values) <= np.abs(values) * 2**-8)
    assert round_to(values, "float16").dtype == np.float32


def _one_ulp_larger(values: np.ndarray, dtype: str) -> np.ndarray:
    """Each value's neighbour in `dtype` one step away from zero."""
    if dtype == "float16":
        halves = values.astype(np.float16)
        return np.nextafter(halves, np.copysign(np.float16(np.inf), halves)).astype(np.float32)
    return (values.astype(np.float32).view(np.uint32) + np.uint32(1 << 16)).view(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_few_one_ulp_rounding_flips_are_forgiven_and_more_are_not(dtype):
    rng = np.random.default_rng(3)
    reference = round_to(rng.standard_normal(2000) * 4, dtype)
    neighbour = _one_ulp_larger(reference, dtype)
    assert np.all(ulps_apart(neighbour, reference, dtype) == 1)
    assert np.all(ulps_apart(_one_ulp_larger(neighbour, dtype), reference, dtype) == 2)
    assert ulps_apart(np.array([0.0, -0.0]), np.array([-0.0, 0.0]), dtype).tolist() == [0, 0]

    largest_first = np.argsort(-np.abs(reference))
    few = largest_first[: int(ROUNDING_FLIP_SHARE * reference.size)]  # where a flip weighs most
    flipped = reference.copy()
    flipped[few] = neighbour[few]
    assert nmse(flipped, reference) > 1e-7 and nmse_beside_rounding_flips(flipped, reference, dtype) == 0

    many = largest_first[: int(ROUNDING_FLIP_SHARE * reference.size) + 1]
    flipped[many] = neighbour[many]
    assert nmse_beside_rounding_flips(flipped, reference, dtype) == math.inf

    two_ulps = reference.copy()
    two_ulps[few[0]] = _one_ulp_larger(neighbour[few[:1]], dtype)[0]
    assert nmse_beside_rounding_flips(two_ulps, reference, dtype) == nmse(two_ulps, reference) > 0
    assert nmse_beside_rounding_flips(reference[:-1], reference, dtype) == math.inf


def test_a_numpy_backends_float16_output_is_judged_against_the_result_rounded_once_to_float16():
    """A backend whose tensors are numpy arrays hands the harness float16 arrays: the exact result
    rounded once must pass, and one rounded twice must not."""
    from candelabra.backends.cpu import CpuBackend
    from candelabra.conformance.harness import Harness

    exact = np.random.default_rng(3).standard_normal((16, 64)) * 3
    once = Harness(CpuBackend(), "float16", seed=1, op="rms_norm")
    once.close("out", exact.astype(np.float16), exact)
    assert once.failures == []
    twice = Harness(CpuBackend(), "float16", seed=1, op="rms_norm")
    twice.close("out", round_to(round_to(exact, "bfloat16"), "float16").astype(np.float16), exact)
    assert twice.failures
