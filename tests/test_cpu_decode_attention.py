"""The torch backend's C decode attention and rotary cache write (decode_attention.py) against the float64
oracle, against the torch ops they replace, and on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from candelabra.backends.torch import attention
from candelabra.backends.torch.attention import TorchStep
from candelabra.backends.torch.cpu import decode_attention, kernel_build, kernel_library
from candelabra.backends.torch.ops import TorchOps
from candelabra.conformance import oracle
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import NO_SLOT, StepMetadata
from candelabra.core.models.rope import cos_sin_table

pytestmark = pytest.mark.skipif(not decode_attention.native_decode_attention_available()[0],
                                reason=decode_attention.native_decode_attention_available()[1])

CPU = torch.device("cpu")
# Worst elementwise error against float64 of attention computed in float32 over keys and values of about 1.
FLOAT32_ERROR = 2e-6


def random_step(rng, seq_lens, block_size, query_lens=None, padded=0):
    """A step of sequences of `seq_lens` tokens on shuffled blocks of a cache with a few spare: (meta, number of
    blocks). `padded` sequences of one token with NO_SLOT are added at the end."""
    query_lens = query_lens or [1] * len(seq_lens)
    needed = [-(-n // block_size) for n in seq_lens]
    blocks = sum(needed) + 3
    order = rng.permutation(blocks)
    tables, at = [], 0
    for count in needed:
        tables.append(order[at:at + count].tolist())
        at += count
    meta = StepMetadata.build(query_lens, seq_lens, tables, block_size)
    if padded:
        slots = np.concatenate([meta.slot_mapping, np.full(padded, NO_SLOT)])
        meta = StepMetadata.build(query_lens + [1] * padded, seq_lens + [1] * padded, tables + [[0]] * padded,
                                  block_size, slot_mapping=slots)
    return meta, blocks


def random_cache(rng, blocks, block_size, kv_heads, head_dim, dtype):
    shape = (blocks, block_size, kv_heads, head_dim)
    return KVCache(*(torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(dtype) for _ in range(2)))


def attention_oracle(q, cache, meta, scale, window=None, cap=None):
    return oracle.paged_attention(q.double().numpy(), cache.key.double().numpy(), cache.value.double().numpy(),
                                  meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, head_dim, window, cap", [
    ((14, 2, ), 64, None, None),   # Qwen2.5-0.5B's heads
    ((8, 8), 80, None, None),      # no grouping; a head dim of 5 x 16
    ((4, 1), 128, 37, None),       # a window shorter than most sequences
    ((6, 2), 256, None, 30.0),     # a soft cap (Gemma 2)
    ((4, 2), 24, 5, 20.0),         # a head dim of no whole vector
])
def test_decode_attention_agrees_with_the_oracle(dtype, heads, head_dim, window, cap):
    rng = np.random.default_rng(head_dim)
    seq_lens = [1, 31, 32, 33, 70, 150]  # tiles of 32 keys: under, at, over, and several
    meta, blocks = random_step(rng, seq_lens, block_size=16)
    cache = random_cache(rng, blocks, 16, heads[1], head_dim, dtype)
    q = torch.from_numpy(rng.standard_normal((len(seq_lens), heads[0], head_dim), dtype=np.float32))
    step = TorchStep.prepare(meta, CPU)
    group = attention.decodes_alone(step)
    out = decode_attention.decode_attention(q, cache, group.block_tables, group.seq_lens, head_dim**-0.5, window, cap)
    reference = attention_oracle(q, cache, meta, head_dim**-0.5, window, cap)
    assert out.dtype == torch.float32
    assert np.abs(out.numpy() - reference).max() <= FLOAT32_ERROR


def test_scores_far_apart_weigh_as_the_oracle_weighs(monkeypatch):
    """Scores spread over hundreds (a few keys take nearly all the weight, most fall under e^-87): the
    vectorised exponential over its whole range, and its floor. Scores of 60 carry float32's rounding of
    60, so the bound is the torch ops' own error, doubled."""
    rng = np.random.default_rng(3)
    meta, blocks = random_step(rng, [300, 41, 8], block_size=16)
    cache = random_cache(rng, blocks, 16, 2, 64, torch.float32)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64), dtype=np.float32)) * 60
    step = TorchStep.prepare(meta, CPU)
    reference = attention_oracle(q, cache, meta, 0.125)
    native = TorchOps(CPU).paged_attention(q, cache, step, 0.125)
    torch_path(monkeypatch)
    torch_ops = TorchOps(CPU).paged_attention(q, cache, step, 0.125)
    torch_error = np.abs(torch_ops.numpy() - reference).max()
    assert np.abs(native.numpy() - reference).max() <= max(2 * torch_error, FLOAT32_ERROR)


def test_a_sequence_attends_the_same_whatever_shares_its_step():
    rng = np.random.default_rng(5)
    meta, blocks = random_step(rng, [90, 7, 40, 200], block_size=16)
    cache = random_cache(rng, blocks, 16, 2, 64, torch.float32)
    q = torch.from_numpy(rng.standard_normal((4, 14, 64), dtype=np.float32))
    step = attention.decodes_alone(TorchStep.prepare(meta, CPU))
    together = decode_attention.decode_attention(q, cache, step.block_tables, step.seq_lens, 0.125, None, None)
    for r in range(4):
        alone = decode_attention.decode_attention(q[r:r + 1], cache, step.block_tables[r:r + 1],
                                                  step.seq_lens[r:r + 1], 0.125, None, None)
        assert torch.equal(alone[0], together[r])


def rotary_inputs(rng, tokens, heads, head_dim, rotary_dim, dtype):
    table = torch.from_numpy(cos_sin_table(rotary_dim, 512, 10000.0))
    qkv = torch.from_numpy(rng.standard_normal((tokens, (heads[0] + 2 * heads[1]) * head_dim), dtype=np.float32))
    qkv = qkv.to(dtype)
    q_width, kv_width = heads[0] * head_dim, heads[1] * head_dim
    # views of one projection's output, as the models split it: strided, not copied
    q = qkv[:, :q_width].reshape(tokens, heads[0], head_dim)
    k = qkv[:, q_width:q_width + kv_width].reshape(tokens, heads[1], head_dim)
    v = qkv[:, q_width + kv_width:].reshape(tokens, heads[1], head_dim)
    return q, k, v, table


def torch_path(monkeypatch):
    """TorchOps with the C kernels turned off, as on a machine where they cannot be built."""
    monkeypatch.setattr(decode_attention, "reads_natively", lambda cache: False)
    monkeypatch.setattr(attention, "reads_natively", lambda cache: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("style, rotary_dim", [("neox", 64), ("gptj", 64), ("neox", 32)])
def test_the_cache_holds_the_keys_torchs_rotary_writes(monkeypatch, dtype, style, rotary_dim):
    rng = np.random.default_rng(7)
    meta, blocks = random_step(rng, [5, 60, 17], 16, query_lens=[5, 1, 3], padded=2)
    q, k, v, table = rotary_inputs(rng, meta.num_tokens, (14, 2), 64, rotary_dim, dtype)
    step = TorchStep.prepare(meta, CPU)
    ops = TorchOps(CPU)
    native_cache = random_cache(rng, blocks, 16, 2, 64, dtype)
    torch_cache = KVCache(native_cache.key.clone(), native_cache.value.clone())
    assert decode_attention.rotates_natively(q, k, v, table, native_cache)
    native_q, _ = ops.rotary_and_write_kv(q, k, v, step.rope_positions, table, native_cache, step.slot_mapping, style)
    torch_path(monkeypatch)
    torch_q, _ = ops.rotary_and_write_kv(q, k, v, step.rope_positions, table, torch_cache, step.slot_mapping, style)
    assert torch.equal(native_q, torch_q)
    assert torch.equal(native_cache.key, torch_cache.key)  # padded tokens wrote nothing
    assert torch.equal(native_cache.value, torch_cache.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [0, 3])
def test_a_step_of_decodes_is_one_call_that_agrees_with_the_torch_ops(monkeypatch, dtype, padded):
    rng = np.random.default_rng(11)
    meta, blocks = random_step(rng, [1, 45, 99, 16], 16, padded=padded)
    q, k, v, table = rotary_inputs(rng, meta.num_tokens, (14, 2), 64, 64, dtype)
    step = TorchStep.prepare(meta, CPU)
    ops = TorchOps(CPU)
    native_cache = random_cache(rng, blocks, 16, 2, 64, dtype)
    torch_cache = KVCache(native_cache.key.clone(), native_cache.value.clone())
    calls = []
    fused = decode_attention.rotary_and_decode_attention
    monkeypatch.setattr(decode_attention, "rotary_and_decode_attention", lambda *a: calls.append(1) or fused(*a))
    native = ops.rotary_and_paged_attention(q, k, v, step.rope_positions, table, native_cache, step.slot_mapping,
                                            step, 0.125, 50, None)[0]
    assert calls == [1]
    torch_path(monkeypatch)
    reference = ops.rotary_and_paged_attention(q, k, v, step.rope_positions, table, torch_cache, step.slot_mapping,
                                               step, 0.125, 50, None)[0]
    assert torch.equal(native_cache.key, torch_cache.key) and torch.equal(native_cache.value, torch_cache.value)
    real = len(meta.seq_lens) - padded
    tolerance = FLOAT32_ERROR if dtype == torch.float32 else 2**-7  # one bfloat16 rounding of the output
    assert (native[:real].float() - reference[:real].float()).abs().max() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_decode_gets_the_same_attention_with_or_without_a_prefill_in_its_step(dtype):
    """A step of decodes alone runs one fused call; beside a prefill the same decodes are rotated and written
    for the whole step, then attended in their own group: bit for bit the same."""
    rng = np.random.default_rng(29)
    mixed, blocks = random_step(rng, [45, 99, 16, 30], 16, query_lens=[1, 1, 1, 10])
    alone = StepMetadata.build([1, 1, 1], [45, 99, 16], [row[row >= 0][: -(-n // 16)].tolist() for row, n in
                                                        zip(mixed.block_tables[:3], [45, 99, 16])], 16)
    q, k, v, table = rotary_inputs(rng, mixed.num_tokens, (14, 2), 64, 64, dtype)
    cache = random_cache(rng, blocks, 16, 2, 64, dtype)
    ops, outputs = TorchOps(CPU), []
    for meta, tokens in ((mixed, mixed.num_tokens), (alone, 3)):
        step = TorchStep.prepare(meta, CPU)
        copy = KVCache(cache.key.clone(), cache.value.clone())
        out, _ = ops.rotary_and_paged_attention(q[:tokens], k[:tokens], v[:tokens], step.rope_positions, table, copy,
                                                step.slot_mapping, step, 0.125)
        outputs.append(out[:3])
    assert torch.equal(outputs[0], outputs[1])


def test_decodes_beside_a_prefill_attend_natively_and_agree_with_the_oracle():
    rng = np.random.default_rng(13)
    meta, blocks = random_step(rng, [40, 70, 9, 33], 16, query_lens=[1, 20, 1, 1])
    cache = random_cache(rng, blocks, 16, 2, 64, torch.float32)
    q = torch.from_numpy(rng.standard_normal((meta.num_tokens, 14, 64), dtype=np.float32))
    out = TorchOps(CPU).paged_attention(q, cache, TorchStep.prepare(meta, CPU), 0.125)
    assert np.abs(out.numpy() - attention_oracle(q, cache, meta, 0.125)).max() <= FLOAT32_ERROR


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keys_of_every_magnitude_round_as_torchs_do(monkeypatch, dtype):
    """Rotated keys from 1e-9 (float16's subnormals and below) to past float16's largest value (65504), rounded
    to the cache's dtype in C: bit for bit what torch's conversion gives."""
    rng = np.random.default_rng(17)
    meta, blocks = random_step(rng, [200, 180, 77], 16, query_lens=[200, 180, 77])
    q, k, v, table = rotary_inputs(rng, meta.num_tokens, (2, 2), 64, 64, torch.float32)
    magnitudes = torch.from_numpy(10.0 ** rng.uniform(-9, np.log10(65504), k.shape)).float()
    k, q = (k.sign() * magnitudes).to(dtype), q.to(dtype)
    v = v.to(dtype)
    step = TorchStep.prepare(meta, CPU)
    ops = TorchOps(CPU)
    native_cache = random_cache(rng, blocks, 16, 2, 64, dtype)
    torch_cache = KVCache(native_cache.key.clone(), native_cache.value.clone())
    ops.rotary_and_write_kv(q, k, v, step.rope_positions, table, native_cache, step.slot_mapping)
    torch_path(monkeypatch)
    ops.rotary_and_write_kv(q, k, v, step.rope_positions, table, torch_cache, step.slot_mapping)
    assert torch.equal(native_cache.key.view(torch.int16), torch_cache.key.view(torch.int16))
    assert torch.isinf(torch_cache.key).any() or dtype == torch.bfloat16  # overflow was reached


def test_bad_input_is_refused_before_the_cache_changes():
    rng = np.random.default_rng(19)
    meta, blocks = random_step(rng, [20, 30], 16)
    q, k, v, table = rotary_inputs(rng, 2, (4, 2), 64, 64, torch.float32)
    cache = random_cache(rng, blocks, 16, 2, 64, torch.float32)
    before = cache.key.clone()
    step = attention.decodes_alone(TorchStep.prepare(meta, CPU))
    rows = torch.tensor([19, 29])
    with pytest.raises(ValueError, match="slot is outside the cache"):
        decode_attention.rotary_and_write(q, k, v, rows, table, cache, torch.tensor([3, blocks * 16]), "neox")
    with pytest.raises(ValueError, match="position is outside the rotary table"):
        decode_attention.rotary_and_write(q, k, v, torch.tensor([19, 512]), table, cache, torch.tensor([3, 4]), "neox")
    with pytest.raises(ValueError, match="block the cache does not have"):
        decode_attention.decode_attention(q, cache, step.block_tables + blocks, step.seq_lens, 0.125, None, None)
    with pytest.raises(ValueError, match="does not fit its block table"):
        decode_attention.decode_attention(q, cache, step.block_tables, step.seq_lens + 16, 0.125, None, None)
    with pytest.raises(ValueError, match="rotary style"):
        decode_attention.rotary_and_write(q, k, v, rows, table, cache, torch.tensor([3, 4]), "interleaved")
    with pytest.raises(ValueError, match="block the cache does not have"):  # the fused call writes nothing either
        decode_attention.rotary_and_decode_attention(q, k, v, rows, table, cache, torch.tensor([3, 4]),
                                                     step.block_tables + blocks, step.seq_lens, 0.125, None, None,
                                                     "neox")
    assert torch.equal(cache.key, before)


# The code other machines run, built at install, run here where this CPU has its flags: 8 lanes without
# AVX-512 (AMD's Zen 3), and the portable build's 128-bit vectors (x86-64 without AVX; aarch64's NEON is as
# wide).
@pytest.mark.parametrize("variant", [v.name for v in kernel_build.VARIANTS])
def test_every_variant_this_cpu_runs_agrees_with_the_oracle(monkeypatch, variant):
    if variant not in {v.name for v in kernel_library.runnable_variants()}:
        pytest.skip(f"this CPU or machine does not run the {variant} kernels")
    build = kernel_library.kernels(variant)
    assert build.library is not None, build.detail
    monkeypatch.setattr(decode_attention, "kernels", lambda: build)
    rng = np.random.default_rng(23)
    meta, blocks = random_step(rng, [3, 64, 100], 16)
    cache = random_cache(rng, blocks, 16, 2, 80, torch.bfloat16)
    q = torch.from_numpy(rng.standard_normal((3, 6, 80), dtype=np.float32))
    step = attention.decodes_alone(TorchStep.prepare(meta, CPU))
    out = decode_attention.decode_attention(q, cache, step.block_tables, step.seq_lens, 0.1, None, None)
    assert np.abs(out.numpy() - attention_oracle(q, cache, meta, 0.1)).max() <= FLOAT32_ERROR
