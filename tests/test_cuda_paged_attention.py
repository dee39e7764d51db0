"""The cuda backend's paged-attention kernels on the GPU or under the Triton interpreter, against the
float64 oracle: decode (split-K), prefill, chunked prefill and mixed batches, GQA, sliding window,
soft-capping, odd head sizes, NaN in every slot the step does not cover, and workspace reuse."""


import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import (
    NOMINAL_MULTIPROCESSORS,
    assume_multiprocessors,
    multiprocessor_count,
)
from candelabra.backends.cuda.kernels.key_segments import (
    MIN_SEGMENT_STEPS,
    decode_segments,
    decode_workspace,
    min_segment_steps,
    segments_of_at_least,
)
from candelabra.backends.cuda.kernels.paged_attention import choose_tiling, decode_tiles, paged_attention
from candelabra.backends.cuda.step import CudaStep
from candelabra.conformance.oracle import paged_attention as oracle_attention
from candelabra.core.contract.step_metadata import StepMetadata
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
# Largest error allowed, relative to the largest reference value: float32 is computed exactly
# (ieee dots); float16 rounds the softmax weights and the output to float16.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3}


class Case:
    """A step over a NaN-poisoned paged cache in which only the step's own keys are real."""

    def __init__(self, seed, query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=torch.float32, cache_dtype=None, max_blocks=None):
        rng = np.random.default_rng(seed)
        cache_dtype = cache_dtype or dtype
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

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key, value = np.full(shape, np.nan), np.full(shape, np.nan)
        for table, length in zip(tables, seq_lens):
            positions = np.arange(length)
            blocks, slots = np.asarray(table)[positions // block_size], positions % block_size
            key[blocks, slots] = rng.standard_normal((length, num_kv_heads, head_dim))
            value[blocks, slots] = rng.standard_normal((length, num_kv_heads, head_dim))
        self.key_cache = torch.from_numpy(key).to(DEVICE, cache_dtype)
        self.value_cache = torch.from_numpy(value).to(DEVICE, cache_dtype)
        # q is a view into a fused qkv projection, as a model hands it over
        tokens = sum(query_lens)
        qkv = torch.from_numpy(rng.standard_normal((tokens, num_heads + 2 * num_kv_heads, head_dim))).to(DEVICE, dtype)
        self.q = qkv[:, :num_heads]
        self.dtype = dtype

    def run(self, scale, sliding_window=None, logit_softcap=None):
        out = paged_attention(self.q, self.key_cache, self.value_cache, self.step, scale,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        expected = oracle_attention(
            float64_values(self.q), float64_values(self.key_cache), float64_values(self.value_cache),
            self.meta.query_start_loc, self.meta.seq_lens, self.meta.block_tables, scale,
            sliding_window=sliding_window, logit_softcap=logit_softcap)
        got = float64_values(out)
        assert np.isfinite(got).all(), "NaN from an unused cache slot reached the output"
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error <= TOLERANCE[self.dtype], f"max relative error {error:.2e}"
        return out


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_only_batch_takes_split_k_and_empty_segments_add_nothing(dtype):
    seq_lens = [1, 17, 600, 1100]
    case = Case(1, [1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2, dtype=dtype)
    # planned for NOMINAL_MULTIPROCESSORS whatever the device: 16 segments, of which the two long sequences
    # fill 3 to 9 (at 32 or 64 keys a step, at least 4 steps a segment) and the short ones one
    assert decode_segments(len(seq_lens), 2, NOMINAL_MULTIPROCESSORS) == 16
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        case.run(scale=0.125)


def poisoned_workspace(num_tokens: int, num_heads: int, head_dim: int, segments: int, dtype=torch.float32):
    workspace = decode_workspace(DEVICE, dtype, num_tokens, num_heads, head_dim, segments)
    for partial in (workspace.partial_out, workspace.partial_max, workspace.partial_sum):
        partial.fill_(float("nan"))
    return workspace


def test_a_sequence_is_split_only_into_segments_of_at_least_four_steps():
    """float32 walks 32 keys a step: 120 keys (4 steps) stay whole, written with no partial results, and
    1,100 (35 steps) of the 16 segments planned fill 9 of 4 steps (the last of 3), the 7 others writing
    nothing."""
    assert MIN_SEGMENT_STEPS == 4 and choose_tiling(1, 2, 64, float32_dot=True).keys == 32
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        segments = decode_segments(2, 2, NOMINAL_MULTIPROCESSORS)
        workspace = poisoned_workspace(2, 4, 64, segments)
        Case(11, [1, 1], [120, 1100], num_heads=4, num_kv_heads=2).run(scale=0.125)
    written = ~torch.isnan(workspace.partial_max).cpu().numpy()
    assert segments == 16 and not written[0].any()
    assert written[1, :, :9].all() and not written[1, :, 9:].any()
    assert not workspace.arrivals.any()


@pytest.mark.parametrize("group", [1, 3, 7])
def test_split_decodes_merge_every_head_of_a_group_of_any_size(group):
    """A split tile's merge covers its token's group of heads, padded to a power of two, not the tile."""
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        Case(15, [1, 1], [40, 1100], num_heads=2 * group, num_kv_heads=2).run(scale=0.125)


def test_the_listed_decodes_of_a_mixed_step_split_and_merge_too():
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        Case(16, [1, 6, 1], [1100, 6, 700], num_heads=8, num_kv_heads=2).run(scale=0.125)


@pytest.mark.parametrize("keys, stages, used", [(16, 1, 11), (32, 2, 6)])
def test_a_decode_tile_may_be_told_its_keys_a_step_and_stages_and_is_refused_what_no_dot_takes(keys, stages, used):
    """700 keys are 44 steps of 16 or 22 of 32 (11 of the 64 float16 takes by itself): segments of at least 4
    steps fill 11 or 6 of the 16 planned."""
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS), decode_tiles(keys, stages):
        workspace = poisoned_workspace(2, 8, 64, decode_segments(2, 2, NOMINAL_MULTIPROCESSORS), torch.float16)
        Case(17, [1, 1], [33, 700], num_heads=8, num_kv_heads=2, dtype=torch.float16).run(scale=0.125)
    written = ~torch.isnan(workspace.partial_max).cpu().numpy()
    assert written[1, :, :used].all() and not written[1, :, used:].any() and not written[0].any()
    for wrong in ((8, 2), (48, 2), (64, 0)):
        with pytest.raises(ValueError, match="power of two of keys"), decode_tiles(*wrong):
            pass


def test_segments_may_be_held_to_fewer_steps_and_no_fewer_than_one():
    """With segments of at least one step, 200 keys (7 steps of 32) fill 7 of the 16 segments."""
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS), segments_of_at_least(1):
        workspace = poisoned_workspace(1, 4, 64, decode_segments(1, 2, NOMINAL_MULTIPROCESSORS))
        Case(13, [1], [200], num_heads=4, num_kv_heads=2).run(scale=0.125)
    written = ~torch.isnan(workspace.partial_max).cpu().numpy()
    assert written[0, :, :7].all() and not written[0, :, 7:].any()
    assert min_segment_steps() == MIN_SEGMENT_STEPS
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS), segments_of_at_least(2**31 - 1):  # never split
        workspace = poisoned_workspace(1, 4, 64, decode_segments(1, 2, NOMINAL_MULTIPROCESSORS))
        Case(14, [1], [1100], num_heads=4, num_kv_heads=2).run(scale=0.125)
    assert torch.isnan(workspace.partial_max).all()
    for wrong in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="at least one step"), segments_of_at_least(wrong):
            pass


def test_a_long_sequence_spreads_its_steps_over_every_segment_past_four_each():
    """2,100 keys are 66 steps of 32: 8 segments of 9 steps (the last of 3)."""
    with assume_multiprocessors(4):  # one sequence x 2 KV heads: 8 segments for 4 programs an SM
        segments = decode_segments(1, 2, 4)
        workspace = poisoned_workspace(1, 4, 64, segments)
        Case(12, [1], [2100], num_heads=4, num_kv_heads=2).run(scale=0.125)
    assert segments == 8 and not torch.isnan(workspace.partial_max).any()


def test_a_decode_batch_that_fills_every_sm_is_not_split():
    assert decode_segments(66, 2, 132) == 1 and decode_segments(64, 8, 132) == 1
    assert decode_segments(65, 2, 132) == 8  # 130 programs, two short of filling the SMs: 4 an SM wanted
    assert decode_segments(1, 8, 132) == 16 and decode_segments(8, 4, 132) == 16 and decode_segments(16, 8, 132) == 8
    assert decode_segments(3, 2, 108) == 16 and decode_segments(40, 2, 108) == 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_batch_that_fills_the_gpu_runs_unsplit(dtype):
    with assume_multiprocessors(4):  # 4 sequences x 2 KV heads fill 4 SMs: one segment, no merge
        case = Case(3, [1, 1, 1, 1], [1, 17, 70, 200], num_heads=8, num_kv_heads=2, dtype=dtype)
        assert decode_segments(4, 2, 4) == 1
        case.run(scale=0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_only_batch_matches_the_oracle(dtype):
    case = Case(2, [5, 23], [5, 23], num_heads=2, num_kv_heads=2, dtype=dtype)
    case.run(scale=0.125)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_of_decodes_prefills_and_chunks(group, dtype):
    # a decode, a prefill long enough for several tiles, a chunk of a prefill over a cached
    # prefix, a one-token sequence and a short prefill
    case = Case(3, [1, 37, 6, 1, 3], [9, 37, 40, 1, 3], num_heads=2 * group, num_kv_heads=2,
                block_size=32, dtype=dtype)
    case.run(scale=0.125)


def test_prefill_tiles_of_one_query_follow_their_sequences():
    """float32 with 32 query heads a KV head leaves room for one query a tile: the tiles of a prefill
    still go by sequence, none of them past the step's last token (a tile once stood for the token of
    its own number, and the last tiles read and wrote rows past the end)."""
    assert choose_tiling(5, 32, 64, float32_dot=True).queries == 1
    Case(5, [1, 4, 3], [6, 4, 9], num_heads=32, num_kv_heads=1, dtype=torch.float32).run(scale=0.125)
    Case(6, [4, 3], [4, 9], num_heads=32, num_kv_heads=1, dtype=torch.float32).run(scale=0.125)


@pytest.mark.parametrize("window", [1, 7])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1], [3, 50, 130]), ([1, 20, 9], [33, 20, 45])],
                         ids=["decode", "mixed"])
def test_sliding_window_attention_matches_the_oracle_in_decode_and_mixed_batches(window, query_lens, seq_lens):
    Case(4, query_lens, seq_lens, num_heads=8, num_kv_heads=2).run(scale=0.125, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [30, 90]), ([1, 14], [25, 30])],
                         ids=["decode", "mixed"])
def test_logit_soft_capping_matches_the_oracle_in_decode_and_mixed_batches(dtype, query_lens, seq_lens):
    # scale 1 gives scores of several units, so a cap of 2 changes the weights a lot
    Case(5, query_lens, seq_lens, num_heads=4, num_kv_heads=1, dtype=dtype).run(scale=1.0, logit_softcap=2.0)


def test_softcap_with_sliding_window():
    Case(6, [1, 11], [60, 19], num_heads=4, num_kv_heads=1).run(scale=1.0, sliding_window=5, logit_softcap=3.0)


@pytest.mark.parametrize("head_dim", [80, 256])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [21, 70]), ([1, 10], [21, 26])],
                         ids=["decode", "mixed"])
def test_head_dims_padded_to_a_power_of_two(head_dim, query_lens, seq_lens):
    Case(7, query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=head_dim).run(scale=head_dim ** -0.5)


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [19, 66]), ([4, 1], [23, 5])], ids=["decode", "mixed"])
def test_float32_cache_with_float16_queries(query_lens, seq_lens):
    case = Case(8, query_lens, seq_lens, dtype=torch.float16, cache_dtype=torch.float32)
    case.run(scale=0.125)


def test_replayed_decode_shapes_reuse_the_workspace_with_new_lengths():
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    first = Case(9, [1, 1, 1], [3, 40, 600], num_heads, num_kv_heads, head_dim, max_blocks=40)
    first.run(scale=0.125)
    segments = decode_segments(3, num_kv_heads, multiprocessor_count(DEVICE))
    workspace = decode_workspace(DEVICE, torch.float32, 3, num_heads, head_dim, segments)
    pointers = [t.data_ptr() for t in (workspace.partial_out, workspace.partial_max, workspace.partial_sum)]

    # same shapes, other lengths: what a CUDA graph replay of the first step would see
    second = Case(10, [1, 1, 1], [500, 2, 17], num_heads, num_kv_heads, head_dim, max_blocks=40)
    assert second.step.block_tables.shape == first.step.block_tables.shape
    second.run(scale=0.125)
    again = decode_workspace(DEVICE, torch.float32, 3, num_heads, head_dim, segments)
    assert [t.data_ptr() for t in (again.partial_out, again.partial_max, again.partial_sum)] == pointers
    # each tile's last segment merged them and left its count at zero for the next replay
    assert segments > 1 and not again.arrivals.any()


@pytest.mark.parametrize("query_lens, decode_tokens", [([1, 5, 1, 3, 1], [0, 6, 10]), ([1, 1, 1], None),
                                                       ([4, 2], None), ([7, 1], [7])])
def test_a_step_lists_its_decodes_only_beside_longer_queries(query_lens, decode_tokens):
    """Attention tiles the decodes of a mixed step apart from its longer queries."""
    tables = [[i] * 2 for i in range(len(query_lens))]
    step = CudaStep.prepare(StepMetadata.build(query_lens, [max(q, 9) for q in query_lens], tables, 16), DEVICE)
    listed = None if step.decode_tokens is None else step.decode_tokens.tolist()
    assert listed == decode_tokens


@pytest.mark.parametrize(("seq_lens", "style", "rotary_dim", "dtype"), [
    ([3, 40, 700], "neox", 64, torch.float16),  # 700 keys: split in segments, the last writes the token's own
    ([1, 90], "gptj", 32, torch.float32),  # partial rotary, the rest passing through
    ([17, 5, 300], "neox", 48, torch.float16),
], ids=["neox-split", "gptj-partial", "neox-partial"])
def test_a_decode_step_rotates_and_writes_its_own_keys_in_the_attention_launch_as_the_rotary_kernel_would(
        seq_lens, style, rotary_dim, dtype):
    from candelabra.backends.cuda.kernels.paged_attention import DecodeRotary, fuses_rotary
    from candelabra.backends.cuda.kernels.rotary import rotary_write_kv

    case = Case(31, [1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2, dtype=dtype)
    rng = np.random.default_rng(32)
    step = case.step
    k, v = (torch.from_numpy(rng.standard_normal((len(seq_lens), 2, 64))).to(DEVICE, dtype) for _ in range(2))
    cos_sin = torch.from_numpy(rng.uniform(-1, 1, (1024, rotary_dim))).to(DEVICE, torch.float32)
    for cache in (case.key_cache, case.value_cache):  # the step's own slots hold NaN until written
        cache.view(-1, 2, 64)[step.slot_mapping] = float("nan")
    caches = [(case.key_cache.clone(), case.value_cache.clone()) for _ in range(2)]
    rotary = DecodeRotary(k, v, step.rope_positions, cos_sin, style, step.slot_mapping)
    assert fuses_rotary(case.q, *caches[0], step, rotary)
    with assume_multiprocessors(NOMINAL_MULTIPROCESSORS):
        fused = paged_attention(case.q, *caches[0], step, 0.125, rotary=rotary)
        rotated_q = rotary_write_kv(case.q, k, v, step.rope_positions, cos_sin, style, *caches[1], step.slot_mapping)
        apart = paged_attention(rotated_q, *caches[1], step, 0.125)
    def same(a, b):  # NaN where the other has NaN (the slots no step wrote), equal elsewhere
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    assert same(caches[0][1], caches[1][1]) and not caches[0][0].view(-1, 2, 64)[step.slot_mapping].isnan().any()
    if DEVICE.type == "cuda":  # where FMA contraction may differ between the two kernels: a rounding step
        torch.testing.assert_close(caches[0][0], caches[1][0], rtol=1e-2, atol=1e-3, equal_nan=True)
        torch.testing.assert_close(fused, apart, rtol=2e-3, atol=2e-3)
    else:
        assert same(caches[0][0], caches[1][0]) and torch.equal(fused, apart)


def test_a_step_of_other_queries_or_a_quantized_cache_keeps_rotary_apart_from_attention():
    from candelabra.backends.cuda.kernels.paged_attention import DecodeRotary, fuses_rotary

    mixed = Case(33, [1, 4], [20, 9])
    k = torch.zeros(5, 2, 64, dtype=torch.float32, device=DEVICE)
    rotary = DecodeRotary(k, k, mixed.step.rope_positions, torch.zeros(64, 64, device=DEVICE), "neox",
                          mixed.step.slot_mapping)
    assert not fuses_rotary(mixed.q, mixed.key_cache, mixed.value_cache, mixed.step, rotary)
    with pytest.raises(ValueError, match="only in a step of decodes alone over a float cache"):
        paged_attention(mixed.q, mixed.key_cache, mixed.value_cache, mixed.step, 0.125, rotary=rotary)
    decode = Case(34, [1, 1], [20, 9])
    rotary = DecodeRotary(k[:2], k[:2], decode.step.rope_positions, torch.zeros(64, 64, device=DEVICE), "neox",
                          decode.step.slot_mapping)
    assert fuses_rotary(decode.q, decode.key_cache, decode.value_cache, decode.step, rotary)
    codes = torch.zeros(*decode.key_cache.shape[:3], 68, dtype=torch.int8, device=DEVICE)
    assert not fuses_rotary(decode.q, codes, codes.clone(), decode.step, rotary)
    odd = DecodeRotary(k[:2], k[:2], decode.step.rope_positions, torch.zeros(64, 66, device=DEVICE), "neox",
                       decode.step.slot_mapping)
    assert not fuses_rotary(decode.q, decode.key_cache, decode.value_cache, decode.step, odd)


@pytest.mark.parametrize("switch, fused", [(None, True), ("1", True), ("0", False)])
def test_the_decode_fusions_switch_sends_a_decode_step_to_the_fused_launch_or_to_the_two_kernels(
        monkeypatch, switch, fused):
    from candelabra.backends.cuda import ops as cuda_ops
    from candelabra.core.contract.ops import KVCache

    if switch is None:
        monkeypatch.delenv(cuda_ops.FUSIONS_SWITCH, raising=False)
    else:
        monkeypatch.setenv(cuda_ops.FUSIONS_SWITCH, switch)
    ops = cuda_ops.CudaOps(DEVICE)
    launched = []
    monkeypatch.setattr(cuda_ops, "paged_attention", lambda *args: launched.append(args[-1]) or args[0])
    decode = Case(35, [1, 1], [20, 9])
    rng = np.random.default_rng(36)
    k = torch.from_numpy(rng.standard_normal((2, 2, 64))).to(DEVICE, torch.float32)
    cos_sin = torch.from_numpy(rng.uniform(-1, 1, (64, 64))).to(DEVICE, torch.float32)

    ops.rotary_and_paged_attention(decode.q, k, k.clone(), decode.step.rope_positions, cos_sin,
                                   KVCache(decode.key_cache, decode.value_cache), decode.step.slot_mapping,
                                   decode.step, 0.125)

    assert ops.fusing == fused
    assert len(launched) == 1 and (launched[0] is not None) == fused
