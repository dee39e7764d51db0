"""The cuda backend's latent-attention kernel (DeepSeek's multi-head latent attention over a latent cache)
on the GPU or under the Triton interpreter, against the float64 oracle: decodes (split-K and unsplit),
prefills, chunked prefills and mixed steps, heads over several tiles, the real models' shapes, caches of
another dtype than the queries, NaN in every slot the step does not cover, and clear errors."""

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import NOMINAL_MULTIPROCESSORS, assume_multiprocessors, interpreting
from candelabra.backends.cuda.kernels.key_segments import decode_segments, decode_workspace
from candelabra.backends.cuda.kernels.latent_attention import MAX_FLOAT32_ROWS, MAX_ROWS, paged_latent_attention
from candelabra.backends.cuda.step import CudaStep
from candelabra.conformance.oracle import paged_latent_attention as oracle_latent_attention
from candelabra.core.contract.step_metadata import StepMetadata
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
# Largest error allowed, relative to the largest reference value: float32 is computed exactly (ieee
# dots); 16-bit dtypes round the softmax weights and the output.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The interpreter gets bfloat16 dots wrong (backends/cuda/backend.py): bfloat16 throughout runs on a GPU.
BFLOAT16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(interpreting(), reason="bfloat16 dots need a GPU"))
DTYPES = [torch.float32, torch.float16, BFLOAT16]


class Case:
    """A step over a NaN-poisoned latent cache (one KV head: rotary keys as the key cache, latents as the
    value cache) in which only the step's own keys are real; tiny-model shapes unless told."""

    def __init__(self, seed, query_lens, seq_lens, heads=4, rank=32, rope_dim=8, block_size=16,
                 dtype=torch.float32, cache_dtype=None, max_blocks=None):
        rng = np.random.default_rng(seed)
        needed = [-(-length // block_size) for length in seq_lens]
        num_blocks = sum(needed) + 3
        block_ids = rng.permutation(num_blocks)
        poison_block = int(block_ids[-1])  # only ever a padding entry of the block tables
        tables, used = [], 0
        for count in needed:
            tables.append([int(b) for b in block_ids[used:used + count]] + [poison_block])
            used += count
        self.meta = StepMetadata.build(query_lens, seq_lens, tables, block_size,
                                       max_blocks=max_blocks or max(needed) + 2)
        self.step = CudaStep.prepare(self.meta, DEVICE)

        rope_keys = np.full((num_blocks, block_size, 1, rope_dim), np.nan)
        latents = np.full((num_blocks, block_size, 1, rank), np.nan)
        for table, length in zip(tables, seq_lens):
            positions = np.arange(length)
            blocks, slots = np.asarray(table)[positions // block_size], positions % block_size
            rope_keys[blocks, slots] = rng.standard_normal((length, 1, rope_dim))
            latents[blocks, slots] = rng.standard_normal((length, 1, rank))
        self.rope_cache = torch.from_numpy(rope_keys).to(DEVICE, cache_dtype or dtype)
        self.latent_cache = torch.from_numpy(latents).to(DEVICE, cache_dtype or dtype)
        tokens = sum(query_lens)
        # q_latent as per_head_linear hands it over (a transposed view), q_rope a slice of the query heads
        self.q_latent = torch.from_numpy(rng.standard_normal((heads, tokens, rank))).to(DEVICE, dtype).transpose(0, 1)
        query = torch.from_numpy(rng.standard_normal((tokens, heads, 16 + rope_dim))).to(DEVICE, dtype)
        self.q_rope = query[..., 16:]
        self.scale = (rank // 4 + rope_dim) ** -0.5
        self.dtype = dtype

    def run(self):
        out = paged_latent_attention(self.q_latent, self.q_rope, self.rope_cache, self.latent_cache, self.step,
                                     self.scale)
        assert out.dtype == self.q_latent.dtype and out.shape == self.q_latent.shape
        expected = oracle_latent_attention(
            float64_values(self.q_latent), float64_values(self.q_rope), float64_values(self.rope_cache),
            float64_values(self.latent_cache), self.meta.query_start_loc, self.meta.seq_lens,
            self.meta.block_tables, self.scale)
        got = float64_values(out)
        assert np.isfinite(got).all(), "NaN from an unused cache slot reached the output"
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error <= TOLERANCE[self.dtype], f"max relative error {error:.2e}"
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_batch_splits_its_keys_and_empty_segments_add_nothing(dtype):
    seq_lens = [1, 17, 70, 700]
    # planned for NOMINAL_MULTIPROCESSORS whatever the device: 4 tiles leave SMs idle, so keys are split
    # into 16 segments: the longest sequence fills 6 to 11 of them (16 or 32 keys a step, at least 4 steps
    # a segment), the others one to 2
    assert decode_segments(len(seq_lens), 1, NOMINAL_MULTIPROCESSORS) == 16
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        Case(1, [1] * len(seq_lens), seq_lens, dtype=dtype).run()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_decode_batch_that_fills_the_gpu_runs_unsplit(dtype):
    with assume_multiprocessors(4):  # 4 tokens of one head tile each fill 4 SMs: one segment, no merge
        assert decode_segments(4, 1, 4) == 1
        Case(2, [1, 1, 1, 1], [1, 17, 70, 200], dtype=dtype).run()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_only_step_matches_the_oracle(dtype):
    Case(3, [5, 23], [5, 23], dtype=dtype).run()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_of_decodes_prefills_and_chunks_matches_the_oracle(dtype):
    # a decode, a prefill of several tiles, a chunk of a prefill over a cached prefix, a one-token
    # sequence and a short prefill
    Case(4, [1, 37, 6, 1, 3], [9, 37, 40, 1, 3], block_size=32, dtype=dtype).run()


# float32 tiles hold 16 rows, 16-bit ones 64: two tiles of heads each, then heads short of a power of two
@pytest.mark.parametrize("dtype, heads", [(torch.float32, 2 * MAX_FLOAT32_ROWS), (torch.float16, MAX_ROWS + 16),
                                          (torch.float32, 5)])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [21, 70]), ([1, 10], [21, 26])], ids=["decode", "mixed"])
def test_heads_beyond_one_tile_or_short_of_a_power_of_two_each_get_their_own_rows(dtype, heads, query_lens, seq_lens):
    Case(5, query_lens, seq_lens, heads=heads, rank=48, rope_dim=16, dtype=dtype).run()


@pytest.mark.parametrize("dtype", [torch.float16, BFLOAT16])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1], [3, 40, 130]), ([1, 19, 1], [50, 19, 7])],
                         ids=["decode", "mixed"])
def test_deepseek_shapes_of_512_latent_and_64_rotary_features_for_16_heads(dtype, query_lens, seq_lens):
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        Case(6, query_lens, seq_lens, heads=16, rank=512, rope_dim=64, dtype=dtype).run()


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [19, 66]), ([4, 1], [23, 5])], ids=["decode", "mixed"])
def test_a_cache_of_another_dtype_than_the_queries_is_read_in_float32(dtype, cache_dtype, query_lens, seq_lens):
    Case(7, query_lens, seq_lens, dtype=dtype, cache_dtype=cache_dtype).run()


def test_replayed_decode_shapes_reuse_the_workspace_with_new_lengths():
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        first = Case(8, [1, 1, 1], [3, 40, 400], max_blocks=30)
        first.run()
        workspace = decode_workspace(DEVICE, torch.float32, 3, 4, 32, decode_segments(3, 1, NOMINAL_MULTIPROCESSORS))
        pointers = [t.data_ptr() for t in (workspace.partial_out, workspace.partial_max, workspace.partial_sum)]

        # same shapes, other lengths: what a CUDA graph replay of the first step would see
        second = Case(9, [1, 1, 1], [300, 2, 17], max_blocks=30)
        assert second.step.block_tables.shape == first.step.block_tables.shape
        second.run()
        again = decode_workspace(DEVICE, torch.float32, 3, 4, 32, decode_segments(3, 1, NOMINAL_MULTIPROCESSORS))
        assert [t.data_ptr() for t in (again.partial_out, again.partial_max, again.partial_sum)] == pointers
        assert not again.arrivals.any()  # each tile's last segment merged them and reset its count


def test_a_cache_with_several_kv_heads_or_queries_that_disagree_are_refused_saying_what_fits():
    case = Case(10, [1, 3], [4, 3])
    two_heads = case.latent_cache.expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match=r"one KV head: key \[blocks, block_size, 1, 8\] and value"):
        paged_latent_attention(case.q_latent, case.q_rope, case.rope_cache, two_heads, case.step, case.scale)
    with pytest.raises(ValueError, match="must agree on T and H"):
        paged_latent_attention(case.q_latent[:, :2], case.q_rope, case.rope_cache, case.latent_cache, case.step,
                               case.scale)
    with pytest.raises(ValueError, match="3 query tokens for a step of 4"):
        paged_latent_attention(case.q_latent[:3], case.q_rope[:3], case.rope_cache, case.latent_cache, case.step,
                               case.scale)
