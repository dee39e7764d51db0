"""The cuda backend's rotary, KV-cache write and fused rotary + write kernels, on the GPU or through
the Triton interpreter, against the float64 oracle."""

import functools

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.kernels.rotary import rotary, rotary_write_kv, write_kv
from candelabra.conformance import oracle
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
DTYPES = {"float32": (torch.float32, np.float32), "float16": (torch.float16, np.float16)}
# rtol, and atol as a fraction of the reference's largest magnitude.
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-3, 1e-5)}
BASE = 10000.0
MAX_POSITIONS = 4096
NO_SLOT = -1
# (tokens, q heads, k heads, head dim, rotary dim): GQA, odd head counts, partial rotary (32 of 80).
ROTARY_SHAPES = [
    (7, 4, 2, 64, 64),
    (5, 3, 1, 80, 80),
    (3, 8, 2, 128, 128),
    (2, 2, 1, 256, 256),
    (6, 5, 3, 80, 32),
    (1, 2, 2, 64, 64),
]


@functools.cache
def cos_sin_table(rotary_dim: int) -> torch.Tensor:
    """[MAX_POSITIONS, rotary_dim] float32: cos then sin of p * BASE**(-2i/rotary_dim)."""
    frequencies = BASE ** (-2 * np.arange(rotary_dim // 2) / rotary_dim)
    angles = np.arange(MAX_POSITIONS)[:, None] * frequencies[None, :]
    return torch.from_numpy(np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)).to(DEVICE)


def random_tensor(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape)).to(DEVICE, DTYPES[dtype][0])


def random_positions(rng, num_tokens, index_dtype):
    positions = rng.integers(0, MAX_POSITIONS, num_tokens)
    positions[0] = MAX_POSITIONS - 1  # the table's last row
    if num_tokens > 1:
        positions[1] = 0
    return torch.from_numpy(positions).to(DEVICE, index_dtype)


def assert_close(out: torch.Tensor, reference: np.ndarray, dtype: str) -> None:
    assert out.dtype == DTYPES[dtype][0] and tuple(out.shape) == reference.shape
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(float64_values(out), reference, rtol=rtol, atol=atol * np.abs(reference).max())


def oracle_rotary(q, k, positions, rotary_dim, style):
    return oracle.rotary(float64_values(q), float64_values(k), positions.cpu().numpy(), rotary_dim, BASE, style)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_matches_the_oracle(shape, style, dtype):
    num_tokens, num_q_heads, num_k_heads, head_dim, rotary_dim = shape
    rng = np.random.default_rng(sum(shape))
    q = random_tensor(rng, (num_tokens, num_q_heads, head_dim), dtype)
    k = random_tensor(rng, (num_tokens, num_k_heads, head_dim), dtype)
    positions = random_positions(rng, num_tokens, torch.int32 if head_dim % 128 else torch.int64)
    inputs_before = q.clone(), k.clone()

    q_rot, k_rot = rotary(q, k, positions, cos_sin_table(rotary_dim), style)

    expected_q, expected_k = oracle_rotary(q, k, positions, rotary_dim, style)
    assert_close(q_rot, expected_q, dtype)
    assert_close(k_rot, expected_k, dtype)
    if rotary_dim < head_dim:
        assert torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(k_rot[..., rotary_dim:], k[..., rotary_dim:])
    assert torch.equal(q, inputs_before[0]) and torch.equal(k, inputs_before[1])


def test_the_two_styles_pair_different_features():
    rng = np.random.default_rng(3)
    q, k = random_tensor(rng, (3, 2, 64), "float32"), random_tensor(rng, (3, 1, 64), "float32")
    positions = torch.tensor([5, 17, 300], device=DEVICE)
    neox, gptj = rotary(q, k, positions, cos_sin_table(64), "neox"), rotary(q, k, positions, cos_sin_table(64), "gptj")
    assert not torch.allclose(neox[0], gptj[0], atol=1e-2)


def test_q_and_k_as_views_of_one_fused_projection():
    # What a model hands over: q, k and v slices of one qkv row, reshaped to heads.
    rng = np.random.default_rng(4)
    num_tokens, num_q_heads, num_k_heads, head_dim = 5, 4, 2, 80
    qkv = random_tensor(rng, (num_tokens, (num_q_heads + 2 * num_k_heads) * head_dim), "float16")
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_k_heads) * head_dim].view(num_tokens, num_k_heads, head_dim)
    positions = random_positions(rng, num_tokens, torch.int64)

    q_rot, k_rot = rotary(q, k, positions, cos_sin_table(32), "neox")

    expected_q, expected_k = oracle_rotary(q, k, positions, 32, "neox")
    assert_close(q_rot, expected_q, "float16")
    assert_close(k_rot, expected_k, "float16")


def random_cache(rng, num_blocks, block_size, num_heads, head_dim, dtype):
    """A cache full of noise, so that a stray write or a lost one shows."""
    return random_tensor(rng, (num_blocks, block_size, num_heads, head_dim), dtype)


def random_slots(rng, num_tokens, num_slots, padding, index_dtype):
    slots = rng.choice(num_slots, size=num_tokens, replace=False)
    if padding == "some":
        slots[rng.choice(num_tokens, size=max(1, num_tokens // 3), replace=False)] = NO_SLOT
    elif padding == "all":
        slots[:] = NO_SLOT
    return torch.from_numpy(slots).to(DEVICE, index_dtype)


def expected_caches(key_cache, value_cache, key, value, slots):
    """The oracle's caches, rounded to the cache dtype as the cast into the cache does."""
    new_key, new_value = oracle.write_kv(
        float64_values(key_cache), float64_values(value_cache), float64_values(key), float64_values(value),
        slots.cpu().numpy(),
    )
    cache_dtype = DTYPES[str(key_cache.dtype).removeprefix("torch.")][1]
    return new_key.astype(cache_dtype).astype(np.float64), new_value.astype(cache_dtype).astype(np.float64)


def assert_caches_equal(key_cache, value_cache, expected_key, expected_value):
    # Exact: written rows are casts, and every other slot must keep its contents bit for bit.
    assert np.array_equal(float64_values(key_cache), expected_key)
    assert np.array_equal(float64_values(value_cache), expected_value)


# (input dtype, cache dtype, block size, padding, slot index dtype)
WRITE_CASES = [
    ("float32", "float32", 16, "none", torch.int64),
    ("float16", "float16", 32, "some", torch.int32),
    ("float16", "float32", 16, "some", torch.int64),
    ("float32", "float16", 32, "none", torch.int32),
    ("float16", "float16", 16, "all", torch.int64),
]


@pytest.mark.parametrize("input_dtype, cache_dtype, block_size, padding, index_dtype", WRITE_CASES)
def test_write_kv_fills_its_slots_and_nothing_else(input_dtype, cache_dtype, block_size, padding, index_dtype):
    rng = np.random.default_rng(block_size + len(padding))
    num_tokens, num_heads, head_dim, num_blocks = 9, 3, 80, 4
    key = random_tensor(rng, (num_tokens, num_heads, head_dim), input_dtype)
    value = random_tensor(rng, (num_tokens, num_heads, head_dim), input_dtype)
    key_cache = random_cache(rng, num_blocks, block_size, num_heads, head_dim, cache_dtype)
    value_cache = random_cache(rng, num_blocks, block_size, num_heads, head_dim, cache_dtype)
    slots = random_slots(rng, num_tokens, num_blocks * block_size, padding, index_dtype)
    expected = expected_caches(key_cache, value_cache, key, value, slots)

    write_kv(key_cache, value_cache, key, value, slots)

    assert_caches_equal(key_cache, value_cache, *expected)


def test_write_kv_into_one_layer_of_a_cache_shared_by_layers():
    rng = np.random.default_rng(21)
    key, value = random_tensor(rng, (6, 2, 64), "float16"), random_tensor(rng, (6, 2, 64), "float16")
    all_keys = random_tensor(rng, (3, 5, 16, 2, 64), "float16")
    all_values = random_tensor(rng, (3, 5, 16, 2, 64), "float16")
    before = all_keys.clone(), all_values.clone()
    slots = random_slots(rng, 6, 5 * 16, "some", torch.int64)
    expected = expected_caches(all_keys[1], all_values[1], key, value, slots)

    write_kv(all_keys[1], all_values[1], key, value, slots)

    assert_caches_equal(all_keys[1], all_values[1], *expected)
    for layer in (0, 2):
        assert torch.equal(all_keys[layer], before[0][layer]) and torch.equal(all_values[layer], before[1][layer])


# (shape, style, input dtype, cache dtype, block size, padding, index dtype)
FUSED_CASES = [
    ((7, 4, 2, 64, 64), "neox", "float32", "float32", 16, "some", torch.int64),
    ((5, 6, 2, 128, 128), "gptj", "float16", "float16", 32, "none", torch.int32),
    ((6, 5, 3, 80, 32), "neox", "float16", "float32", 16, "some", torch.int32),
    ((3, 2, 1, 256, 256), "gptj", "float16", "float16", 16, "all", torch.int64),
    ((4, 3, 1, 80, 32), "gptj", "float32", "float32", 32, "some", torch.int64),
]


@pytest.mark.parametrize("shape, style, input_dtype, cache_dtype, block_size, padding, index_dtype", FUSED_CASES)
def test_rotary_write_kv_rotates_q_like_rotary_and_caches_the_rotated_k(
    shape, style, input_dtype, cache_dtype, block_size, padding, index_dtype
):
    num_tokens, num_q_heads, num_k_heads, head_dim, rotary_dim = shape
    rng = np.random.default_rng(sum(shape) + block_size)
    q = random_tensor(rng, (num_tokens, num_q_heads, head_dim), input_dtype)
    k = random_tensor(rng, (num_tokens, num_k_heads, head_dim), input_dtype)
    v = random_tensor(rng, (num_tokens, num_k_heads, head_dim), input_dtype)
    positions = random_positions(rng, num_tokens, index_dtype)
    num_blocks = 3
    key_cache = random_cache(rng, num_blocks, block_size, num_k_heads, head_dim, cache_dtype)
    value_cache = random_cache(rng, num_blocks, block_size, num_k_heads, head_dim, cache_dtype)
    slots = random_slots(rng, num_tokens, num_blocks * block_size, padding, index_dtype)
    table = cos_sin_table(rotary_dim)
    unfused_q, unfused_k = rotary(q, k, positions, table, style)
    expected = expected_caches(key_cache, value_cache, unfused_k, v, slots)

    k_before = k.clone()
    q_rot = rotary_write_kv(q, k, v, positions, table, style, key_cache, value_cache, slots)

    assert torch.equal(q_rot, unfused_q)
    expected_q, expected_k = oracle_rotary(q, k, positions, rotary_dim, style)
    assert_close(q_rot, expected_q, input_dtype)
    assert_close(unfused_k, expected_k, input_dtype)
    assert_caches_equal(key_cache, value_cache, *expected)  # the rotated k, as rotary gives it
    assert torch.equal(k, k_before)  # k itself is left as it was


def test_bad_arguments_are_refused():
    q, k = torch.ones(2, 2, 64, device=DEVICE), torch.ones(2, 1, 64, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="style"):
        rotary(q, k, positions, cos_sin_table(64), "llama")
    with pytest.raises(ValueError, match="rotary dim"):
        rotary(q, k, positions, torch.ones(8, 128, device=DEVICE), "neox")
    with pytest.raises(ValueError, match="cache"):
        cache = torch.ones(2, 16, 2, 64, device=DEVICE)
        write_kv(cache, cache, k, k, positions)


def test_no_tokens_launch_nothing():
    empty, no_positions = torch.empty(0, 2, 64, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_rot, k_rot = rotary(empty, empty, no_positions, cos_sin_table(64))
    assert q_rot.shape == k_rot.shape == (0, 2, 64)
    cache = torch.ones(1, 16, 2, 64, device=DEVICE)
    write_kv(cache, cache, empty, empty, no_positions)
    assert torch.equal(cache, torch.ones_like(cache))
