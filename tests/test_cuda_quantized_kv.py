"""The cuda backend's int8 and fp8 KV caches, on the GPU or through the Triton interpreter: the cache write
(apart and fused with rotary) stores each row's codes then its float32 scale exactly as a float32 numpy
quantizer does, and paged and latent attention over the bytes written match the float64 oracle run on those
bytes decoded (fp8 through torch.float8_e4m3fn), in prefill, decode (split-K) and mixed steps, with GQA."""

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import assume_multiprocessors
from candelabra.backends.cuda.backend import FP8_CAPABILITY, CudaBackend
from candelabra.backends.cuda.kernels.key_segments import decode_segments
from candelabra.backends.cuda.kernels.latent_attention import paged_latent_attention
from candelabra.backends.cuda.kernels.paged_attention import paged_attention
from candelabra.backends.cuda.kernels.rotary import rotary, rotary_write_kv, write_kv
from candelabra.backends.cuda.step import CudaStep
from candelabra.conformance import oracle
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import StepMetadata
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
CODE_MAX = {"int8": 127, "fp8": 448}
# Triton's float8e4nv, which attention reads fp8 codes through, does not build below compute capability 8.9.
FP8_MISSING = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) < FP8_CAPABILITY
FP8_MARKS = [pytest.mark.skipif(FP8_MISSING, reason="an fp8 cache needs compute capability 8.9 or later")]
CODES = ["int8", pytest.param("fp8", marks=FP8_MARKS)]
DTYPES = [torch.float32, torch.float16]
# Largest attention error allowed, relative to the largest reference value, against the oracle on the
# decoded cache: float32 multiplies exactly; float16 rounds the decoded values, the weights and the output.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3}
# Bytes in every slot no step writes: an int8 code of -1, an fp8 NaN, and a NaN scale.
POISON = 0xFF


def quantize(values: np.ndarray, codes: str) -> np.ndarray:
    """The reference: rows values [..., D] as their stored bytes [..., D + 4] (uint8), in float32 numpy."""
    rows = np.asarray(values, dtype=np.float32)
    scale = (np.abs(rows).max(axis=-1, keepdims=True) / np.float32(CODE_MAX[codes])).astype(np.float32)
    scaled = (rows / np.where(scale > 0, scale, np.float32(1))).astype(np.float32)
    if codes == "int8":
        stored = np.clip(np.rint(scaled), -127, 127).astype(np.int8).view(np.uint8)
    else:
        stored = torch.from_numpy(np.clip(scaled, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        stored = np.where(stored == 0x80, 0, stored)  # torch keeps a zero's sign; the cache stores +0
    scale_bytes = np.ascontiguousarray(scale.astype("<f4")).view(np.uint8)
    return np.concatenate([stored, scale_bytes], axis=-1).astype(np.uint8)


def decode(stored: np.ndarray, codes: str) -> np.ndarray:
    """Stored rows [..., D + 4] (uint8) as their values [..., D], float64."""
    stored = np.ascontiguousarray(stored)
    scale = stored[..., -4:].copy().view("<f4").astype(np.float64)
    raw = stored[..., :-4].copy()
    if codes == "int8":
        values = raw.view(np.int8).astype(np.float64)
    else:
        values = torch.from_numpy(raw).view(torch.float8_e4m3fn).double().numpy()
    return values * scale


def cache_bytes(cache: torch.Tensor) -> np.ndarray:
    return cache.view(torch.uint8).cpu().numpy()


def poisoned_cache(shape, codes: str) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.uint8, device=DEVICE).view(STORAGE[codes])


def random_rows(rng, shape, dtype) -> torch.Tensor:
    """Rows of different magnitudes, as a model's keys are."""
    magnitudes = 10.0 ** rng.uniform(-1, 1, (*shape[:-1], 1))
    return torch.from_numpy(rng.standard_normal(shape) * magnitudes).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16"])
@pytest.mark.parametrize("codes", CODES)
def test_write_kv_stores_each_rows_codes_then_its_scale_as_the_reference_quantizes_them(codes, dtype):
    rng = np.random.default_rng(1)
    tokens, heads, head_dim, value_dim, block_size = 6, 3, 20, 36, 4
    key, value = random_rows(rng, (tokens, heads, head_dim), dtype), random_rows(rng, (tokens, heads, value_dim), dtype)
    key[2, 1] = 0  # a row of zeros: scale 0, codes 0
    slots = torch.tensor([5, 0, 11, -1, 7, 2], device=DEVICE)  # one NO_SLOT token writes nothing
    key_cache = poisoned_cache((4, block_size, heads, head_dim + 4), codes)
    value_cache = poisoned_cache((4, block_size, heads, value_dim + 4), codes)

    write_kv(key_cache, value_cache, key, value, slots)

    for cache, rows, width in ((key_cache, key, head_dim), (value_cache, value, value_dim)):
        expected = np.full((4 * block_size, heads, width + 4), POISON, dtype=np.uint8)
        written = slots.cpu().numpy() >= 0
        expected[slots.cpu().numpy()[written]] = quantize(float64_values(rows)[written], codes)
        np.testing.assert_array_equal(cache_bytes(cache).reshape(expected.shape), expected)
    assert not cache_bytes(key_cache).reshape(-1, heads, head_dim + 4)[11, 1, :].any()


@pytest.mark.parametrize("codes", CODES)
def test_halfway_codes_round_to_even_and_fp8_saturates_at_448(codes):
    """A row whose largest magnitude is the code maximum has scale 1: its values are the scaled values."""
    if codes == "int8":
        halfway = np.arange(-126.5, 127, 1.0)
    else:
        grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
        halfway = (grid[1:] + grid[:-1]) / 2  # every midpoint between neighbouring e4m3 values
        halfway = np.concatenate([halfway, -halfway, [-447.9, 1e-6, -1e-6]])
    row = np.concatenate([[CODE_MAX[codes]], halfway]).astype(np.float32)
    key = torch.from_numpy(row).reshape(1, 1, -1).to(DEVICE)
    cache = poisoned_cache((1, 1, 1, row.size + 4), codes)

    write_kv(cache, cache.clone(), key, key, torch.zeros(1, dtype=torch.int64, device=DEVICE))

    stored = cache_bytes(cache).reshape(-1)
    np.testing.assert_array_equal(stored, quantize(row, codes))
    assert stored[-4:].view("<f4")[0] == 1.0
    if codes == "int8":
        np.testing.assert_array_equal(stored[1:-4].view(np.int8), np.rint(halfway))


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["whole", "partial"])
def test_rotary_with_the_cache_write_stores_the_rotated_keys_quantized(codes, rotary_dim):
    rng = np.random.default_rng(2)
    tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 32
    q = random_rows(rng, (tokens, q_heads, head_dim), torch.float16)
    k = random_rows(rng, (tokens, kv_heads, head_dim), torch.float16)
    v = random_rows(rng, (tokens, kv_heads, head_dim), torch.float16)
    positions = torch.from_numpy(rng.integers(0, 64, tokens)).to(DEVICE)
    angles = np.arange(64)[:, None] * 10000.0 ** (-2 * np.arange(rotary_dim // 2) / rotary_dim)
    cos_sin = torch.from_numpy(np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 6, 1], device=DEVICE)
    key_cache = poisoned_cache((2, 4, kv_heads, head_dim + 4), codes)
    value_cache = poisoned_cache((2, 4, kv_heads, head_dim + 4), codes)

    q_out = rotary_write_kv(q, k, v, positions, cos_sin, "neox", key_cache, value_cache, slots)

    q_rotated, k_rotated = rotary(q, k, positions, cos_sin, "neox")
    torch.testing.assert_close(q_out, q_rotated, rtol=0, atol=0)
    written = slots.cpu().numpy() >= 0
    for cache, rows in ((key_cache, k_rotated), (value_cache, v)):
        stored = cache_bytes(cache).reshape(8, kv_heads, head_dim + 4)
        np.testing.assert_array_equal(stored[slots.cpu().numpy()[written]],
                                      quantize(float64_values(rows)[written], codes))
        assert (stored[[2, 4, 5, 7]] == POISON).all()


class Step:
    """A step over poisoned quantized caches, its block tables in shuffled order: its sequences' earlier
    keys and values quantized by the reference, its own tokens' written by write_kv, as a model's layer
    writes them before it attends (random rows of mixed magnitudes)."""

    def __init__(self, rng, query_lens, seq_lens, key_dim, value_dim, heads, codes, dtype, block_size=16):
        needed = [-(-length // block_size) for length in seq_lens]
        block_ids = rng.permutation(sum(needed) + 2)
        tables, used = [], 0
        for count in needed:
            tables.append([int(b) for b in block_ids[used:used + count]] + [int(block_ids[-1])])
            used += count
        self.meta = StepMetadata.build(query_lens, seq_lens, tables, block_size, max_blocks=max(needed) + 2)
        self.step = CudaStep.prepare(self.meta, DEVICE)
        shape = (len(block_ids), block_size, heads)
        self.key_cache = poisoned_cache((*shape, key_dim + 4), codes)
        self.value_cache = poisoned_cache((*shape, value_dim + 4), codes)

        context = [table_slots(table, range(length - new), block_size)
                   for table, length, new in zip(tables, seq_lens, query_lens)]
        for cache, width in ((self.key_cache, key_dim), (self.value_cache, value_dim)):
            rows = random_rows(rng, (sum(map(len, context)), heads, width), torch.float32)
            stored = cache_bytes(cache).reshape(-1, heads, width + 4)
            stored[np.concatenate(context)] = quantize(float64_values(rows), codes)
            cache.copy_(torch.from_numpy(stored.reshape(cache.shape)).view(cache.dtype))
        new_slots = np.concatenate([table_slots(table, range(length - new, length), block_size)
                                    for table, length, new in zip(tables, seq_lens, query_lens)])
        keys = random_rows(rng, (len(new_slots), heads, key_dim), dtype)
        write_kv(self.key_cache, self.value_cache, keys, random_rows(rng, (len(new_slots), heads, value_dim), dtype),
                 torch.from_numpy(new_slots).to(DEVICE))
        stored_keys = cache_bytes(self.key_cache).reshape(-1, heads, key_dim + 4)[new_slots]
        np.testing.assert_array_equal(stored_keys, quantize(float64_values(keys), codes))
        self.decoded_keys = decode(cache_bytes(self.key_cache), codes)  # NaN where poisoned
        self.decoded_values = decode(cache_bytes(self.value_cache), codes)

    def relative_error(self, got: torch.Tensor, expected: np.ndarray) -> float:
        got = float64_values(got)
        assert np.isfinite(got).all(), "a poisoned slot reached the output"
        return np.abs(got - expected).max() / np.abs(expected).max()


def table_slots(table: list[int], positions, block_size: int) -> np.ndarray:
    positions = np.asarray(positions, dtype=np.int64)
    return np.asarray(table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


STEPS = {  # (query_lens, seq_lens)
    "prefill": ([5, 12], [5, 12]),
    "decode": ([1, 1], [17, 600]),  # the longer split (key_segments.MIN_SEGMENT_STEPS), the shorter whole
    "mixed": ([1, 4, 1], [20, 4, 3]),
}
# Each cache with each dtype and each kind of step, in a few cases: the interpreter takes seconds a case.
def attention_cases(*cases) -> list:
    return [pytest.param(kind, codes, dtype, id=f"{kind}-{codes}-{str(dtype).removeprefix('torch.')}",
                         marks=FP8_MARKS if codes == "fp8" else ()) for kind, codes, dtype in cases]


ATTENTION_CASES = attention_cases(
    ("prefill", "int8", torch.float16), ("prefill", "fp8", torch.float32), ("decode", "int8", torch.float32),
    ("decode", "fp8", torch.float16), ("mixed", "int8", torch.float16), ("mixed", "fp8", torch.float32))
# A decode step's keys split into 8 segments: 2 sequences x 2 KV heads fill 8 SMs with 4 programs each.
SPLIT_FOR = 8


@pytest.mark.parametrize("kind, codes, dtype", ATTENTION_CASES)
def test_paged_attention_over_a_written_quantized_cache_matches_the_oracle_on_its_decoded_bytes(kind, codes, dtype):
    rng = np.random.default_rng(3)
    query_lens, seq_lens = STEPS[kind]
    heads, kv_heads, head_dim = 8, 2, 32  # 4 query heads a KV head
    case = Step(rng, query_lens, seq_lens, head_dim, head_dim, kv_heads, codes, dtype)
    q = torch.from_numpy(rng.standard_normal((sum(query_lens), heads, head_dim))).to(DEVICE, dtype)
    assert kind != "decode" or decode_segments(len(seq_lens), kv_heads, SPLIT_FOR) == 8

    with assume_multiprocessors(SPLIT_FOR):
        out = paged_attention(q, case.key_cache, case.value_cache, case.step, head_dim ** -0.5)

    expected = oracle.paged_attention(float64_values(q), case.decoded_keys, case.decoded_values,
                                      case.meta.query_start_loc, case.meta.seq_lens, case.meta.block_tables,
                                      head_dim ** -0.5)
    assert out.dtype == dtype and case.relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("kind, codes, dtype", attention_cases(("decode", "fp8", torch.float16),
                                                                ("mixed", "int8", torch.float32)))
def test_latent_attention_over_a_written_quantized_latent_cache_matches_the_oracle(kind, codes, dtype):
    rng = np.random.default_rng(4)
    query_lens, seq_lens = STEPS[kind]
    heads, rank, rope_dim = 4, 32, 8
    case = Step(rng, query_lens, seq_lens, rope_dim, rank, 1, codes, dtype)
    tokens = sum(query_lens)
    q_latent = torch.from_numpy(rng.standard_normal((tokens, heads, rank))).to(DEVICE, dtype)
    q_rope = torch.from_numpy(rng.standard_normal((tokens, heads, rope_dim))).to(DEVICE, dtype)
    scale = (rank // 4 + rope_dim) ** -0.5

    with assume_multiprocessors(SPLIT_FOR):
        out = paged_latent_attention(q_latent, q_rope, case.key_cache, case.value_cache, case.step, scale)

    expected = oracle.paged_latent_attention(float64_values(q_latent), float64_values(q_rope), case.decoded_keys,
                                             case.decoded_values, case.meta.query_start_loc, case.meta.seq_lens,
                                             case.meta.block_tables, scale)
    assert out.dtype == dtype and case.relative_error(out, expected) <= TOLERANCE[dtype]


def test_the_backend_offers_int8_and_fp8_caches_and_allocates_them_as_rows_of_codes_and_scale():
    backend = CudaBackend()
    for compute in CudaBackend.dtypes:
        assert {"int8", "fp8"} <= set(CudaBackend.kv_cache_dtypes(compute))
        assert CudaBackend.check_kv_cache_dtype("fp8", compute) == "fp8"
    for codes, storage in STORAGE.items():
        spec = KVCacheSpec(1, 3, 16, 2, 24, codes, value_dim=40)
        if codes == "fp8" and FP8_MISSING:
            with pytest.raises(ValueError, match="compute capability 8.9 or later"):
                backend.allocate_kv_cache(spec)
            continue
        (cache,) = backend.allocate_kv_cache(spec)
        assert cache.key.dtype == cache.value.dtype == storage
        assert tuple(cache.key.shape) == (3, 16, 2, 28) and tuple(cache.value.shape) == (3, 16, 2, 44)


def test_caches_quantized_unlike_each_other_or_of_the_wrong_width_are_refused():
    key = torch.zeros(2, 1, 8, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    int8_cache = torch.zeros(1, 4, 1, 12, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="quantized alike"):
        write_kv(int8_cache, int8_cache.view(torch.uint8), key, key, slots)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 1, 8 \+ 4 scale bytes\]"):
        write_kv(int8_cache[..., :8], int8_cache[..., :8], key, key, slots)
