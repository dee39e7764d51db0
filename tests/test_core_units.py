"""KV cache sizing, rope tables, comparison helpers and the cpu backend's non-op calls."""

import math

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.compare import ROUNDING_FLIP_SHARE, nmse, nmse_beside_rounding_flips, round_to, ulps_apart
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import OP_NAMES, OpNotSupported, Ops
from candelabra.core.models.rope import RopeScaling, cos_sin_table, rope_frequencies


def test_kv_cache_spec_sizes_blocks_from_memory():
    spec = KVCacheSpec(num_layers=24, num_blocks=1, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    assert spec.bytes_per_block == 24 * 2 * 16 * 2 * 64 * 2
    sized = spec.with_blocks_for(512 * 2**20)
    assert sized.num_blocks == 512 * 2**20 // spec.bytes_per_block
    assert sized.capacity_tokens == sized.num_blocks * 16
    with pytest.raises(ValueError, match="holds no KV block"):
        spec.with_blocks_for(1000)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        KVCacheSpec(1, 1, 16, 0, 64)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        KVCacheSpec(1, 1, 16, 1, 64, "float8")


def test_rope_table_layout_and_linear_scaling():
    table = cos_sin_table(8, 5, 10000.0)
    freqs = rope_frequencies(8, 10000.0)
    assert table.shape == (5, 8) and table.dtype == np.float32
    np.testing.assert_allclose(table[3, :4], np.cos(3 * freqs), rtol=1e-6)
    np.testing.assert_allclose(table[3, 4:], np.sin(3 * freqs), rtol=1e-6)
    linear = rope_frequencies(8, 10000.0, RopeScaling.from_hf({"type": "linear", "factor": 2.0}, 2048))
    np.testing.assert_allclose(linear, freqs / 2)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    scaling = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384)
    table = cos_sin_table(64, 2, 1e6, scaling)
    assert table[0, 0] == pytest.approx(0.1 * math.log(4.0) + 1)


def test_unknown_rope_scaling_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope scaling 'ntk-by-parts'"):
        RopeScaling.from_hf({"type": "ntk-by-parts"}, 4096)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_frequencies(7, 10000.0)


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
