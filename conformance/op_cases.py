"""Level 1 of conformance: every op, and the KV block and array calls, on a grid of real shapes.

Each check draws fresh random inputs from the harness, runs the backend (after a poisoned run),
and compares with the float64 oracle.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from candelabra.conformance import oracle
from candelabra.conformance.compare import (
    QUANTIZED_KV_CODE_SLACK,
    QUANTIZED_KV_NMSE_THRESHOLDS,
    QUANTIZED_KV_SCALE_RTOL,
    QUANTIZED_NMSE_THRESHOLDS,
    round_to,
)
from candelabra.conformance.harness import Case, Harness
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.dtypes import QUANTIZED_KV_DTYPES
from candelabra.core.contract.kv_cache import KV_STORAGE_DTYPES, KVCacheSpec
from candelabra.core.contract.kv_quantization import KV_CODE_MAX, quantize_kv_rows
from candelabra.core.contract.ops import KVCache, OpNotSupported
from candelabra.core.contract.step_metadata import (
    NO_SLOT,
    SamplingMetadata,
    StepMetadata,
    pad_token_lists,
    token_mask_words,
)
from candelabra.core.contract.weights import (
    GGUF_QUANTIZED_FORMATS,
    INT4_GROUP_FORMATS,
    QuantizedTensor,
    WeightRole,
)
from candelabra.core.models.rope import RopeScaling, cos_sin_table
from candelabra.core.models.sharding import take_experts

# How far a sampled token's inverse-CDF interval may sit from the draw: float32 cumulative sums
# over a large vocabulary drift by about this much.
CDF_TOLERANCE = 1e-4


def check_embedding(h: Harness, vocab: int, hidden: int, tokens: int, scaled: bool) -> None:
    table = h.rand(vocab, hidden)
    ids = h.rng.integers(0, vocab, tokens)
    scale = math.sqrt(hidden) if scaled else None
    out = h.call(h.backend.ops.embedding, h.upload(ids), h.upload(table), scale)
    h.close("out", out, oracle.embedding(ids, table, scale))


def check_gather_rows(h: Harness, tokens: int, hidden: int, picked: int) -> None:
    x = h.rand(tokens, hidden)
    rows = h.rng.integers(0, tokens, picked)
    out = h.call(h.backend.ops.gather_rows, h.upload(x), h.upload(rows))
    h.equal("out", out, oracle.gather_rows(x, rows))


def check_linear(h: Harness, tokens: int, in_features: int, out_features: int, bias: bool,
                 role: str = "linear") -> None:
    x = h.rand(tokens, in_features)
    weight = h.rand(out_features, in_features, scale=in_features**-0.5)
    b = h.rand(out_features) if bias else None
    out = h.call(h.backend.ops.linear, h.upload(x), h.upload_weight("proj.weight", WeightRole(role), weight),
                 None if b is None else h.upload_weight("proj.bias", WeightRole.BIAS, b))
    h.close("out", out, oracle.linear(x, weight, b))


def check_quantized_linear(h: Harness, format: str, tokens: int, in_features: int, out_features: int, bias: bool,
                           role: str = "linear", column_order: bool = False) -> None:
    """The oracle multiplies by the weight's dequantized values, which is what the op promises. With
    `column_order`, the weight's columns are stored in a random order (an act-order GPTQ weight)."""
    if format not in h.backend.quantized_formats:
        raise OpNotSupported(h.backend.name, "linear", f"it keeps no {format} weights (quantized_formats)")
    x = h.rand(tokens, in_features)
    weight = random_quantized(h.rng, format, out_features, in_features)
    if column_order:
        weight = QuantizedTensor(format, weight.blocks, weight.shape, h.rng.permutation(in_features))
    b = h.rand(out_features) if bias else None
    out = h.call(h.backend.ops.linear, h.upload(x), h.upload_weight("proj.weight", WeightRole(role), weight),
                 None if b is None else h.upload_weight("proj.bias", WeightRole.BIAS, b))
    h.close("out", out, oracle.linear(x, weight.dequantize(), b),
            threshold=max(h.threshold, QUANTIZED_NMSE_THRESHOLDS[format]))


def check_rms_norm(h: Harness, shape: tuple, weight_offset: float) -> None:
    x = h.rand(*shape, scale=3.0)
    weight = h.rand(shape[-1], scale=0.2, offset=1.0 - weight_offset)
    out = h.call(h.backend.ops.rms_norm, h.upload(x), h.upload(weight), 1e-6, weight_offset)
    h.close("out", out, oracle.rms_norm(x, weight, 1e-6, weight_offset))


def check_add_rms_norm(h: Harness, shape: tuple, weight_offset: float) -> None:
    x, residual = h.rand(*shape), h.rand(*shape, scale=4.0)
    weight = h.rand(shape[-1], scale=0.2, offset=1.0 - weight_offset)
    normed, summed = h.call(
        h.backend.ops.add_rms_norm, h.upload(x), h.upload(residual), h.upload(weight), 1e-5, weight_offset
    )
    ref_normed, ref_summed = oracle.add_rms_norm(
        x, residual, weight, 1e-5, weight_offset, round_sum=lambda a: round_to(a, h.dtype)
    )
    h.close("normed", normed, ref_normed)
    h.close("residual", summed, ref_summed)


def check_layer_norm(h: Harness, shape: tuple, bias: bool) -> None:
    x = h.rand(*shape, scale=2.0, offset=0.5)
    weight = h.rand(shape[-1], scale=0.2, offset=1.0)
    b = h.rand(shape[-1], scale=0.1) if bias else None
    out = h.call(h.backend.ops.layer_norm, h.upload(x), h.upload(weight), None if b is None else h.upload(b), 1e-5)
    h.close("out", out, oracle.layer_norm(x, weight, b, 1e-5))


ROPE_SCALINGS = {
    "default": (10000.0, None),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
}
ROPE_MAX_POSITIONS = 16384


def check_rotary(
    h: Harness, tokens: int, heads: tuple, head_dim: int, rotary_dim: int | None, style: str, scaling: str
) -> None:
    """rotary_dim None rotates the whole head."""
    q_heads, kv_heads = heads
    rotary_dim = rotary_dim or head_dim
    base, hf_scaling = ROPE_SCALINGS[scaling]
    table = cos_sin_table(rotary_dim, ROPE_MAX_POSITIONS, base, RopeScaling.from_hf(hf_scaling, ROPE_MAX_POSITIONS))
    q, k = h.rand(tokens, q_heads, head_dim), h.rand(tokens, kv_heads, head_dim)
    positions = h.rng.integers(0, ROPE_MAX_POSITIONS, tokens)
    q_out, k_out = h.call(
        h.backend.ops.rotary, h.upload(q), h.upload(k), h.upload(positions),
        h.backend.to_device(table, "float32"), style,
    )
    q_ref, k_ref = oracle.rotary(q, k, positions, rotary_dim, base, style, hf_scaling)
    h.close("q", q_out, q_ref)
    h.close("k", k_out, k_ref)


def check_silu_and_mul(h: Harness, tokens: int, intermediate: int) -> None:
    x = h.rand(tokens, 2 * intermediate, scale=2.0)
    h.close("out", h.call(h.backend.ops.silu_and_mul, h.upload(x)), oracle.silu_and_mul(x))


def check_gelu_and_mul(h: Harness, tokens: int, intermediate: int, approximate: str) -> None:
    x = h.rand(tokens, 2 * intermediate, scale=2.0)
    out = h.call(h.backend.ops.gelu_and_mul, h.upload(x), approximate)
    h.close("out", out, oracle.gelu_and_mul(x, approximate))


def check_gated_linear(h: Harness, tokens: int, intermediate: int, out_features: int, activation: str,
                       bias: bool, format: str | None = None) -> None:
    """The oracle's gated values are not rounded before the product: a backend may round them or not."""
    if format is not None and format not in h.backend.quantized_formats:
        raise OpNotSupported(h.backend.name, "gated_linear", f"it keeps no {format} weights (quantized_formats)")
    x = h.rand(tokens, 2 * intermediate, scale=2.0)
    weight = (h.rand(out_features, intermediate, scale=intermediate**-0.5) if format is None
              else random_quantized(h.rng, format, out_features, intermediate))
    b = h.rand(out_features) if bias else None
    out = h.call(h.backend.ops.gated_linear, h.upload(x), h.upload_weight("down.weight", WeightRole.LINEAR, weight),
                 None if b is None else h.upload_weight("down.bias", WeightRole.BIAS, b), activation)
    gated = (oracle.silu_and_mul(x) if activation == "silu"
             else oracle.gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none"))
    dense = weight if format is None else weight.dequantize()
    h.close("out", out, oracle.linear(gated, dense, b),
            threshold=None if format is None else max(h.threshold, QUANTIZED_NMSE_THRESHOLDS[format]))


def check_rms_norm_linear(h: Harness, tokens: int, hidden: int, out_features: int, residual: bool,
                          weight_offset: float, bias: bool, format: str | None = None) -> None:
    """The oracle's normalised values are not rounded before the product: a backend may round them or not."""
    if format is not None and format not in h.backend.quantized_formats:
        raise OpNotSupported(h.backend.name, "rms_norm_linear", f"it keeps no {format} weights (quantized_formats)")
    x, added = h.rand(tokens, hidden), h.rand(tokens, hidden, scale=4.0) if residual else None
    norm_weight = h.rand(hidden, scale=0.2, offset=1.0 - weight_offset)
    weight = (h.rand(out_features, hidden, scale=hidden**-0.5) if format is None
              else random_quantized(h.rng, format, out_features, hidden))
    b = h.rand(out_features) if bias else None
    out, joined = h.call(
        h.backend.ops.rms_norm_linear, h.upload(x), None if added is None else h.upload(added), h.upload(norm_weight),
        1e-5, h.upload_weight("proj.weight", WeightRole.LINEAR, weight),
        None if b is None else h.upload_weight("proj.bias", WeightRole.BIAS, b), weight_offset)
    if added is None:
        normed, ref_joined = oracle.rms_norm(x, norm_weight, 1e-5, weight_offset), x
    else:
        normed, ref_joined = oracle.add_rms_norm(x, added, norm_weight, 1e-5, weight_offset,
                                                 round_sum=lambda a: round_to(a, h.dtype))
    dense = weight if format is None else weight.dequantize()
    h.close("out", out, oracle.linear(normed, dense, b),
            threshold=None if format is None else max(h.threshold, QUANTIZED_NMSE_THRESHOLDS[format]))
    h.close("residual", joined, ref_joined)


def check_rms_norm_gated_mlp(h: Harness, tokens: int, hidden: int, intermediate: int, residual: bool,
                             activation: str, bias: bool, format: str | None = None) -> None:
    """The oracle rounds none of the normalised values, the gate and up products or the gated values: a backend
    may round any of them."""
    if format is not None and format not in h.backend.quantized_formats:
        raise OpNotSupported(h.backend.name, "rms_norm_gated_mlp", f"it keeps no {format} weights (quantized_formats)")
    x, added = h.rand(tokens, hidden), h.rand(tokens, hidden, scale=4.0) if residual else None
    norm_weight = h.rand(hidden, scale=0.2, offset=1.0)
    out_features = hidden
    if format is None:
        gate_up = h.rand(2 * intermediate, hidden, scale=hidden**-0.5)
        down = h.rand(out_features, intermediate, scale=intermediate**-0.5)
    else:
        gate_up = random_quantized(h.rng, format, 2 * intermediate, hidden)
        down = random_quantized(h.rng, format, out_features, intermediate)
    gate_up_bias, down_bias = (h.rand(2 * intermediate), h.rand(out_features)) if bias else (None, None)
    out, joined = h.call(
        h.backend.ops.rms_norm_gated_mlp, h.upload(x), None if added is None else h.upload(added),
        h.upload(norm_weight), 1e-5, h.upload_weight("gate_up.weight", WeightRole.LINEAR, gate_up),
        h.upload_weight("down.weight", WeightRole.LINEAR, down),
        None if gate_up_bias is None else h.upload_weight("gate_up.bias", WeightRole.BIAS, gate_up_bias),
        None if down_bias is None else h.upload_weight("down.bias", WeightRole.BIAS, down_bias), 0.0, activation)
    if added is None:
        normed, ref_joined = oracle.rms_norm(x, norm_weight, 1e-5), x
    else:
        normed, ref_joined = oracle.add_rms_norm(x, added, norm_weight, 1e-5, round_sum=lambda a: round_to(a, h.dtype))
    dense_gate_up, dense_down = (w if format is None else w.dequantize() for w in (gate_up, down))
    projected = oracle.linear(normed, dense_gate_up, gate_up_bias)
    gated = (oracle.silu_and_mul(projected) if activation == "silu"
             else oracle.gelu_and_mul(projected, "tanh" if activation == "gelu_tanh" else "none"))
    h.close("out", out, oracle.linear(gated, dense_down, down_bias),
            threshold=None if format is None else max(h.threshold, QUANTIZED_NMSE_THRESHOLDS[format]))
    h.close("residual", joined, ref_joined)


def check_gelu(h: Harness, shape: tuple, approximate: str) -> None:
    x = h.rand(*shape, scale=3.0)
    h.close("out", h.call(h.backend.ops.gelu, h.upload(x), approximate), oracle.gelu(x, approximate))


def check_softcap(h: Harness, shape: tuple, cap: float) -> None:
    x = h.rand(*shape, scale=2 * cap)
    h.close("out", h.call(h.backend.ops.softcap, h.upload(x), cap), oracle.softcap(x, cap))


def check_softmax(h: Harness, shape: tuple, magnitude: str) -> None:
    # "large" logits overflow exp() unless the maximum is subtracted first.
    x = h.rand(*shape, scale=20.0, offset=1000.0) if magnitude == "large" else h.rand(*shape, scale=2.0)
    h.close("out", h.call(h.backend.ops.softmax, h.upload(x)), oracle.softmax(x))


def check_write_kv(h: Harness, block_size: int, kv_heads: int, head_dim: int, tokens: int, padding: str,
                   kv_dtype: str | None = None, value_dim: int | None = None) -> None:
    """padding: how many tokens carry slot -1 ("none", "some" or "all"). kv_dtype: the cache's,
    when not the compute dtype. value_dim: the values' width where it is not head_dim (a latent cache).
    A quantized cache's written rows must each hold the right scale and the nearest codes, a row of
    zeros among them."""
    kv_dtype, value_dim = kv_dtype or h.dtype, value_dim or head_dim
    num_blocks = tokens // block_size + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = _stored(h.rand(*shape), kv_dtype)
    value_cache = _stored(h.rand(*shape[:3], value_dim), kv_dtype)
    slots = h.rng.choice(num_blocks * block_size, tokens, replace=False)
    if padding == "some":
        slots[h.rng.permutation(tokens)[: max(tokens // 4, 1)]] = NO_SLOT
    elif padding == "all":
        slots[:] = NO_SLOT
    key, value = h.rand(tokens, kv_heads, head_dim), h.rand(tokens, kv_heads, value_dim)
    if kv_dtype in QUANTIZED_KV_DTYPES:
        key[-1, 0] = 0
    cache = h.call(h.backend.ops.write_kv, h.upload_cache(key_cache, value_cache, kv_dtype), h.upload(key),
                   h.upload(value), h.upload(slots))
    storage = KV_STORAGE_DTYPES.get(kv_dtype, kv_dtype)
    h.require("cache dtype", h.backend.dtype_of(cache.key) == storage, h.backend.dtype_of(cache.key))
    if kv_dtype in QUANTIZED_KV_DTYPES:
        _check_quantized_write(h, "key cache", cache.key, key_cache, slots, key, kv_dtype)
        _check_quantized_write(h, "value cache", cache.value, value_cache, slots, value, kv_dtype)
        return
    ref_key, ref_value = oracle.write_kv(key_cache, value_cache, key, value, slots)
    h.slots_equal("key cache", cache.key, round_to(ref_key, kv_dtype), slots, round_to(key, kv_dtype))
    h.slots_equal("value cache", cache.value, round_to(ref_value, kv_dtype), slots, round_to(value, kv_dtype))


def _stored(values: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Cache rows [..., D] as a cache in `kv_dtype` holds them: rounded to it, or quantized ([..., D + 4])."""
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return quantize_kv_rows(values, kv_dtype)
    return round_to(values, kv_dtype)


def _read_back(stored: np.ndarray, kv_dtype: str) -> np.ndarray:
    """The values a cache part holds (float64 where it is quantized)."""
    return oracle.dequantized_kv(stored, kv_dtype) if kv_dtype in QUANTIZED_KV_DTYPES else stored


def _written_and_untouched(h: Harness, name: str, part, before: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """A quantized cache part's rows at the written slots, by token, after requiring every other row unchanged."""
    got = h.host(part)
    rows, rows_before = got.reshape(-1, *got.shape[2:]), before.reshape(-1, *before.shape[2:])
    written = slots[slots != NO_SLOT]
    untouched = np.setdiff1d(np.arange(len(rows_before)), written)
    h.equal(f"{name} rows not written", rows[untouched], rows_before[untouched])
    return rows[written]


def _check_quantized_write(h: Harness, name: str, part, before: np.ndarray, slots: np.ndarray, values: np.ndarray,
                           kv_dtype: str) -> None:
    """The rows of `values` written at `slots` (the others untouched), each with scale max|row| / the largest
    code and the codes nearest value / scale: within half a code step of the values."""
    stored = _written_and_untouched(h, name, part, before, slots)
    values = values[slots != NO_SLOT].astype(np.float64)
    codes, scales = oracle.kv_rows(stored, kv_dtype)
    expected = np.abs(values).max(axis=-1, keepdims=True) / KV_CODE_MAX[kv_dtype]
    wrong = ~(np.abs(scales - expected) <= QUANTIZED_KV_SCALE_RTOL * expected)
    if wrong.any():
        first = tuple(int(i) for i in np.argwhere(wrong)[0][:-1])
        h.require(f"{name} scales", False, f"{int(wrong.sum())} of {wrong.size} rows' scales are not max|row| / "
                                           f"{KV_CODE_MAX[kv_dtype]:g}: row {first} has {scales[first][0]:.6g}, "
                                           f"expected {expected[first][0]:.6g}")
        return
    x = np.divide(values, scales, out=np.zeros_like(values), where=scales > 0)
    nearest = np.abs(oracle.nearest_kv_codes(x, kv_dtype) - x)
    off = ~(np.abs(codes - x) <= nearest + QUANTIZED_KV_CODE_SLACK * np.maximum(1.0, np.abs(x)))
    if off.any():
        first = tuple(int(i) for i in np.argwhere(off)[0])
        h.require(f"{name} codes", False, f"{int(off.sum())} of {off.size} codes are not the nearest to value / "
                                          f"scale: at {first} {codes[first]:g} for {x[first]:.6g}")


def check_rotary_and_write_kv(h: Harness, tokens: int, heads: tuple, head_dim: int, block_size: int, style: str,
                              padding: str, value_dim: int | None = None, kv_dtype: str | None = None) -> None:
    """The rotated keys may go to the cache without first being rounded to the compute dtype, so
    the written keys are compared within the op's threshold (and, in a quantized cache, the
    quantization's); every other slot must be untouched. value_dim: the values' width where it is not
    head_dim (a latent cache). kv_dtype: a quantized cache's, when not the compute dtype."""
    q_heads, kv_heads = heads
    value_dim, kv_dtype = value_dim or head_dim, kv_dtype or h.dtype
    base, hf_scaling = ROPE_SCALINGS["default"]
    table = cos_sin_table(head_dim, ROPE_MAX_POSITIONS, base, RopeScaling.from_hf(hf_scaling, ROPE_MAX_POSITIONS))
    num_blocks = tokens // block_size + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = _stored(h.rand(*shape), kv_dtype), _stored(h.rand(*shape[:3], value_dim), kv_dtype)
    slots = h.rng.choice(num_blocks * block_size, tokens, replace=False)
    if padding == "some":
        slots[h.rng.permutation(tokens)[: max(tokens // 4, 1)]] = NO_SLOT
    q, k, v = h.rand(tokens, q_heads, head_dim), h.rand(tokens, kv_heads, head_dim), h.rand(tokens, kv_heads, value_dim)
    positions = h.rng.integers(0, ROPE_MAX_POSITIONS, tokens)
    q_out, cache = h.call(
        h.backend.ops.rotary_and_write_kv, h.upload(q), h.upload(k), h.upload(v), h.upload(positions),
        h.backend.to_device(table, "float32"), h.upload_cache(key_cache, value_cache, kv_dtype), h.upload(slots), style,
    )
    q_ref, k_ref = oracle.rotary(q, k, positions, head_dim, base, style, hf_scaling)
    h.close("q", q_out, q_ref)
    if kv_dtype in QUANTIZED_KV_DTYPES:
        keys = _written_and_untouched(h, "key cache", cache.key, key_cache, slots)
        h.close("written keys", oracle.dequantized_kv(keys, kv_dtype), k_ref[slots != NO_SLOT],
                threshold=max(h.threshold, QUANTIZED_KV_NMSE_THRESHOLDS[kv_dtype]))
        _check_quantized_write(h, "value cache", cache.value, value_cache, slots, v, kv_dtype)
        return
    ref_key, ref_value = oracle.write_kv(key_cache, value_cache, k_ref, v, slots)
    written = slots[slots != NO_SLOT]
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    keys = h.host(cache.key).reshape(num_blocks * block_size, kv_heads, head_dim)
    h.close("written keys", keys[written], round_to(ref_key.reshape(keys.shape)[written], h.dtype))
    h.equal("untouched keys", keys[untouched], key_cache.reshape(keys.shape)[untouched])
    h.slots_equal("value cache", cache.value, round_to(ref_value, h.dtype), slots, round_to(v, h.dtype))


# (query_len, seq_len) per sequence: decodes, full prefills, chunks of a prefill after cached
# context, exactly full and partial last blocks, from 1 to a few hundred tokens.
ATTENTION_BATCHES = {
    "mixed": [(1, 1), (1, 17), (33, 33), (1, 100), (20, 75), (1, 64), (48, 130), (1, 257)],
    "decode": [(1, 5), (1, 16), (1, 32), (1, 200), (1, 311), (1, 48)],
    "prefill": [(300, 300), (7, 7), (64, 64)],
}


def _paged_step(h: Harness, batch: str, block_size: int, padded: int = 0):
    """A step of ATTENTION_BATCHES[batch] over shuffled blocks, the padding entries of its block tables
    real block ids that must not be read: (its metadata, the cache's block count, each sequence's slots).

    `padded` sequences follow as a captured decode pads its batch: one token each, writing nowhere
    (NO_SLOT) and reading the first row of one block that no sequence of the step uses."""
    query_lens, seq_lens = zip(*ATTENTION_BATCHES[batch])
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 5
    shuffled = h.rng.permutation(num_blocks)
    starts = np.cumsum([0, *needed])
    tables = [shuffled[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]
    slots = None
    if padded:
        written = StepMetadata.build(query_lens, seq_lens, tables, block_size).slot_mapping
        slots = np.concatenate([written, np.full(padded, NO_SLOT, written.dtype)])
        query_lens, seq_lens = (*query_lens, *[1] * padded), (*seq_lens, *[1] * padded)
        tables, needed = [*tables, *[[int(shuffled[-1])]] * padded], [*needed, *[1] * padded]
    meta = StepMetadata.build(query_lens, seq_lens, tables, block_size, slot_mapping=slots)
    for b, count in enumerate(needed):
        meta.block_tables[b, count:] = h.rng.integers(0, num_blocks, meta.block_tables.shape[1] - count)
    seq_slots = [np.array([tables[b][j // block_size] * block_size + j % block_size for j in range(seq_len)])
                 for b, seq_len in enumerate(seq_lens)]
    return meta, num_blocks, seq_slots


def check_paged_attention(
    h: Harness, head_dim: int, heads: tuple, block_size: int, batch: str,
    sliding_window: int | None = None, logit_softcap: float | None = None, kv_dtype: str | None = None,
) -> None:
    """kv_dtype: the cache's, when not the compute dtype; the oracle reads a quantized cache's rows as
    their codes times their scales."""
    kv_dtype = kv_dtype or h.dtype
    q_heads, kv_heads = heads
    meta, num_blocks, seq_slots = _paged_step(h, batch, block_size)

    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    for slots in seq_slots:
        seq_len = len(slots)
        key_cache.reshape(-1, kv_heads, head_dim)[slots] = h.rand(seq_len, kv_heads, head_dim)
        value_cache.reshape(-1, kv_heads, head_dim)[slots] = h.rand(seq_len, kv_heads, head_dim)
    key_cache, value_cache = _stored(key_cache, kv_dtype), _stored(value_cache, kv_dtype)
    q = h.rand(meta.num_tokens, q_heads, head_dim, scale=3.0 if logit_softcap else 1.0)
    scale = head_dim**-0.5

    step = h.backend.prepare_step(meta)
    out = h.call(h.backend.ops.paged_attention, h.upload(q), h.upload_cache(key_cache, value_cache, kv_dtype), step,
                 scale, sliding_window=sliding_window, logit_softcap=logit_softcap)
    h.require("output dtype", h.backend.dtype_of(out) == h.dtype, h.backend.dtype_of(out))
    reference = oracle.paged_attention(q, _read_back(key_cache, kv_dtype), _read_back(value_cache, kv_dtype),
                                       meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, sliding_window,
                                       logit_softcap)
    h.close("out", out, reference)


def check_rotary_and_paged_attention(h: Harness, head_dim: int, heads: tuple, block_size: int, batch: str,
                                     style: str, rotary_dim: int | None = None,
                                     sliding_window: int | None = None, padded: int = 0) -> None:
    """The step's own keys and values are NaN in the cache until the op writes them; the oracle rotates q and k
    in float64 and reads the keys as the cache holds them (rounded to the compute dtype), q unrounded: a
    backend may round the rotated q or not. Every slot the step does not write must be left as it was,
    the row a padded sequence reads too (see `_paged_step`)."""
    q_heads, kv_heads = heads
    rotary_dim = rotary_dim or head_dim
    base, hf_scaling = ROPE_SCALINGS["default"]
    table = cos_sin_table(rotary_dim, ROPE_MAX_POSITIONS, base, RopeScaling.from_hf(hf_scaling, ROPE_MAX_POSITIONS))
    meta, num_blocks, _ = _paged_step(h, batch, block_size, padded)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = h.rand(*shape), h.rand(*shape)
    rows = lambda cache: cache.reshape(-1, kv_heads, head_dim)  # noqa: E731
    new_slots = meta.slot_mapping[meta.slot_mapping != NO_SLOT]
    rows(key_cache)[new_slots], rows(value_cache)[new_slots] = np.nan, np.nan
    q = h.rand(meta.num_tokens, q_heads, head_dim)
    k, v = h.rand(meta.num_tokens, kv_heads, head_dim), h.rand(meta.num_tokens, kv_heads, head_dim)
    scale = head_dim**-0.5

    out, cache = h.call(
        h.backend.ops.rotary_and_paged_attention, h.upload(q), h.upload(k), h.upload(v), h.upload(meta.rope_positions),
        h.backend.to_device(table, "float32"), h.upload_cache(key_cache, value_cache, h.dtype),
        h.upload(meta.slot_mapping), h.backend.prepare_step(meta), scale, sliding_window, None, style)
    h.require("output dtype", h.backend.dtype_of(out) == h.dtype, h.backend.dtype_of(out))
    q_ref, k_ref = oracle.rotary(q, k, meta.rope_positions, rotary_dim, base, style, hf_scaling)
    ref_key, ref_value = oracle.write_kv(key_cache, value_cache, round_to(k_ref, h.dtype), v, new_slots)
    keys = h.host(cache.key).reshape(-1, kv_heads, head_dim)
    h.close("written keys", keys[new_slots], rows(ref_key)[new_slots])
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), new_slots)
    h.equal("untouched keys", keys[untouched], rows(key_cache)[untouched])
    h.slots_equal("value cache", cache.value, ref_value, meta.slot_mapping, v)
    reference = oracle.paged_attention(q_ref, ref_key, ref_value, meta.query_start_loc, meta.seq_lens,
                                       meta.block_tables, scale, sliding_window)
    h.close("out", out, reference)


def check_per_head_linear(h: Harness, tokens: int, heads: int, in_features: int, out_features: int) -> None:
    x = h.rand(tokens, heads, in_features)
    weight = h.rand(heads, out_features, in_features, scale=in_features**-0.5)
    out = h.call(h.backend.ops.per_head_linear, h.upload(x),
                 h.upload_weight("self_attn.absorbed", WeightRole.PER_HEAD, weight))
    h.require("output dtype", h.backend.dtype_of(out) == h.dtype, h.backend.dtype_of(out))
    h.close("out", out, oracle.per_head_linear(x, weight))


def check_paged_latent_attention(h: Harness, heads: int, rank: int, rope_dim: int, block_size: int,
                                 batch: str, kv_dtype: str | None = None) -> None:
    """A latent cache (one KV head: rotary keys as the key cache, latents as the value cache), with NaN
    in every slot the step does not own. kv_dtype: a quantized cache's, when not the compute dtype."""
    kv_dtype = kv_dtype or h.dtype
    meta, num_blocks, seq_slots = _paged_step(h, batch, block_size)
    key_cache = np.full((num_blocks, block_size, 1, rope_dim), np.nan, np.float32)
    value_cache = np.full((num_blocks, block_size, 1, rank), np.nan, np.float32)
    for slots in seq_slots:
        seq_len = len(slots)
        key_cache.reshape(-1, 1, rope_dim)[slots] = h.rand(seq_len, 1, rope_dim)
        value_cache.reshape(-1, 1, rank)[slots] = h.rand(seq_len, 1, rank)
    key_cache, value_cache = _stored(key_cache, kv_dtype), _stored(value_cache, kv_dtype)
    q_latent, q_rope = h.rand(meta.num_tokens, heads, rank), h.rand(meta.num_tokens, heads, rope_dim)
    scale = (rank // 4 + rope_dim) ** -0.5
    out = h.call(h.backend.ops.paged_latent_attention, h.upload(q_latent), h.upload(q_rope),
                 h.upload_cache(key_cache, value_cache, kv_dtype), h.backend.prepare_step(meta), scale)
    h.require("output dtype", h.backend.dtype_of(out) == h.dtype, h.backend.dtype_of(out))
    h.close("out", out, oracle.paged_latent_attention(q_latent, q_rope, _read_back(key_cache, kv_dtype),
                                                      _read_back(value_cache, kv_dtype), meta.query_start_loc,
                                                      meta.seq_lens, meta.block_tables, scale))


SAMPLING_MODES = ("greedy", "temperature", "top_k", "top_p", "min_p", "combined", "penalties", "allowed")


def _sampling_metadata(h: Harness, rows: int, vocab: int, mode: str, logprobs: int) -> SamplingMetadata:
    rng = h.rng
    enabled = lambda name: mode in (name, "combined")  # noqa: E731
    temperature = np.zeros(rows) if mode == "greedy" else rng.uniform(0.5, 1.5, rows)
    if mode in ("combined", "penalties"):
        temperature[: rows // 3] = 0  # some greedy rows among the random ones
    empty = [[] for _ in range(rows)]
    penalise = mode == "penalties"
    penalty_tokens = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(rows)] if penalise else empty
    output_tokens = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in range(rows)] if penalise else empty
    bias_ids = [rng.integers(0, vocab, 5).tolist() for _ in range(rows)] if penalise else empty
    bias_values = [rng.uniform(-5, 5, len(ids)).tolist() for ids in bias_ids]
    if mode == "allowed":
        temperature[: rows // 2] = 0
    return SamplingMetadata(
        temperature=temperature.astype(np.float32),
        top_k=(rng.integers(1, 50, rows) if enabled("top_k") else np.zeros(rows)).astype(np.int32),
        top_p=(rng.uniform(0.5, 0.95, rows) if enabled("top_p") else np.ones(rows)).astype(np.float32),
        min_p=(rng.uniform(0.01, 0.2, rows) if enabled("min_p") else np.zeros(rows)).astype(np.float32),
        repetition_penalty=(rng.uniform(1.1, 1.5, rows) if penalise else np.ones(rows)).astype(np.float32),
        presence_penalty=(rng.uniform(0, 1, rows) if penalise else np.zeros(rows)).astype(np.float32),
        frequency_penalty=(rng.uniform(0, 1, rows) if penalise else np.zeros(rows)).astype(np.float32),
        penalty_tokens=pad_token_lists(penalty_tokens),
        output_tokens=pad_token_lists(output_tokens),
        bias_token_ids=pad_token_lists(bias_ids),
        bias_values=_pad_values(bias_values),
        uniform=rng.random(rows, dtype=np.float32),
        num_top_logprobs=logprobs,
        allowed_token_mask=allowed_token_mask(rng, rows, vocab) if mode == "allowed" else None,
    )


def allowed_token_mask(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Row 0 allows a single token, row 1 all but one, the others a random share of the
    vocabulary (a few tokens to most of it); the padding bits past the vocabulary are set, and
    must be ignored."""
    allowed = np.zeros((rows, token_mask_words(vocab) * 32), dtype=bool)
    allowed[:, vocab:] = True
    allowed[0, rng.integers(vocab)] = True
    allowed[1, :vocab] = True
    allowed[1, rng.integers(vocab)] = False
    for row in range(2, rows):
        allowed[row, :vocab] = rng.random(vocab) < rng.choice([0.002, 0.05, 0.5, 0.9])
        allowed[row, rng.integers(vocab)] = True
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32)


def _top_p_boundary_row(logits: np.ndarray, meta: SamplingMetadata, dtype: str) -> None:
    """Row 0 becomes three tokens of probability 0.5, 0.3 and 0.2 in increasing id order, top_p 0.6
    and a draw of 0.99: the first two are the candidates (the third starts past 0.6) and the draw
    takes the second. Random rows catch a filter that keeps the token crossing top_p only when a draw
    happens to land where it shifts the others; this row catches it every time."""
    vocab = logits.shape[1]
    logits[0] = -30.0
    logits[0, [1, vocab // 2, vocab - 2]] = round_to(np.log([0.5, 0.3, 0.2]), dtype)
    meta.temperature[0], meta.top_p[0], meta.uniform[0] = 1.0, 0.6, 0.99


def _pad_values(lists: list[list[float]]) -> np.ndarray:
    """Float counterpart of pad_token_lists: same shape, zero padded."""
    out = np.zeros(pad_token_lists(lists).shape, dtype=np.float32)
    for row, values in enumerate(lists):
        out[row, : len(values)] = values
    return out


def check_sample(h: Harness, rows: int, vocab: int, mode: str, logprobs: int, tied: bool = False) -> None:
    """`tied` puts logits on a coarse grid, so that many tie (as low-precision logits do)."""
    logits = h.rand(rows, vocab, scale=3.0)
    if tied:
        logits = np.round(logits * 2) / 2
    meta = _sampling_metadata(h, rows, vocab, mode, logprobs)
    if mode == "top_p":
        _top_p_boundary_row(logits, meta, h.dtype)
    result = h.call(h.backend.ops.sample, h.upload(logits), h.backend.prepare_sampling(meta))
    ref = oracle.sample(logits, meta)
    tokens = h.host(result.token_ids).astype(np.int64)
    h.require("token ids shape", tokens.shape == (rows,), f"got {tokens.shape}")
    same = tokens == ref["token_ids"]
    for row in np.flatnonzero(~same):
        token, u = tokens[row], float(meta.uniform[row])
        if meta.temperature[row] == 0 or not 0 <= token < vocab:
            h.require(f"row {row}", False, f"chose {token}, expected {ref['token_ids'][row]}")
        else:
            inside = (ref["candidates"][row, token]
                      and ref["cdf_low"][row, token] - CDF_TOLERANCE <= u < ref["cdf_high"][row, token] + CDF_TOLERANCE)
            h.require(f"row {row}", inside, f"chose {token} for draw {u:.6f}, expected {ref['token_ids'][row]}")
    rows_index = np.arange(rows)[:, None]
    if tokens.shape == (rows,) and np.all((tokens >= 0) & (tokens < vocab)):
        h.close("logprobs", result.logprobs, ref["all_logprobs"][rows_index[:, 0], tokens])
    # Equal logprobs may come in any order: each returned id must carry the value returned for
    # it, and the values must be the oracle's top values.
    top_ids = h.host(result.top_token_ids).astype(np.int64)
    h.close("top logprobs", result.top_logprobs, ref["top_logprobs"])
    h.require("top token ids shape", top_ids.shape == ref["top_token_ids"].shape, f"got {top_ids.shape}")
    if top_ids.shape == ref["top_token_ids"].shape and top_ids.size:
        h.require("top token ids in range", bool(np.all((top_ids >= 0) & (top_ids < vocab))))
        h.require("top token ids distinct", all(len(set(row)) == len(row) for row in top_ids.tolist()))
        h.close("logprobs of top token ids", ref["all_logprobs"][rows_index, np.clip(top_ids, 0, vocab - 1)],
                ref["top_logprobs"])


def check_token_logprobs(h: Harness, rows: int, vocab: int, num_top: int, tied: bool = False) -> None:
    """`tied` puts logits on a coarse grid, so that ranks count past ties."""
    logits = h.rand(rows, vocab, scale=3.0)
    if tied:
        logits = np.round(logits * 2) / 2
    token_ids = h.rng.integers(0, vocab, rows)
    token_ids[0] = int(np.argmax(logits[0]))  # the most likely token has rank 1
    result = h.call(h.backend.ops.token_logprobs, h.upload(logits), h.upload(token_ids), num_top)
    ref = oracle.token_logprobs(logits, token_ids, num_top)
    h.close("logprobs", result.logprobs, ref["logprobs"])
    ranks = h.host(result.ranks).astype(np.int64)
    h.require("ranks shape", ranks.shape == (rows,), f"got {ranks.shape}")
    if ranks.shape == (rows,):
        # Float32 may tell apart, or merge, logprobs that float64 finds a hair away from the token's.
        near = ref["all_logprobs"] - ref["logprobs"][:, None]
        lowest, highest = 1 + np.sum(near > 1e-5, axis=1), np.sum(near > -1e-5, axis=1)  # the token's own: 0
        wrong = np.flatnonzero((ranks < lowest) | (ranks > highest))
        h.require("ranks", not wrong.size, f"rows {wrong.tolist()}: got {ranks[wrong].tolist()}, "
                                            f"expected {ref['ranks'][wrong].tolist()}")
    top_ids = h.host(result.top_token_ids).astype(np.int64)
    h.close("top logprobs", result.top_logprobs, ref["top_logprobs"])
    h.require("top token ids shape", top_ids.shape == (rows, num_top), f"got {top_ids.shape}")
    if top_ids.shape == (rows, num_top) and top_ids.size:
        h.require("top token ids in range", bool(np.all((top_ids >= 0) & (top_ids < vocab))))
        h.require("top token ids distinct", all(len(set(row)) == len(row) for row in top_ids.tolist()))
        picked = ref["all_logprobs"][np.arange(rows)[:, None], np.clip(top_ids, 0, vocab - 1)]
        h.close("logprobs of top token ids", picked, ref["top_logprobs"])


# route_experts' arguments as the families that use them set them (see `Ops.route_experts`).
ROUTINGS = {
    "softmax": {"scoring": "softmax"},  # Mixtral, Qwen3-MoE with norm_topk_prob
    "softmax_scaled": {"scoring": "softmax", "renormalize": False, "scale": 2.5},
    "deepseek_v2": {"scoring": "softmax", "renormalize": False, "scale": 16.0, "num_groups": 8, "top_groups": 3,
                    "group_scoring": "max"},
    "deepseek_v3": {"scoring": "sigmoid", "scale": 2.5, "num_groups": 8, "top_groups": 4,
                    "group_scoring": "top2_sum", "correction_bias": True},
}


def check_route_experts(h: Harness, tokens: int, experts: int, top_k: int, routing: str) -> None:
    """The ids are judged exactly: random logits make ties improbable, and a tie is broken the same
    way everywhere (the lower id first)."""
    arguments = dict(ROUTINGS[routing])
    logits = h.rand(tokens, experts, scale=2.0)
    bias = h.rng.standard_normal(experts).astype(np.float32) * 0.3 if arguments.pop("correction_bias", False) else None
    weights, ids = h.call(h.backend.ops.route_experts, h.upload(logits), top_k, **arguments,
                          correction_bias=None if bias is None else h.upload(bias, "float32"))
    ref_weights, ref_ids = oracle.route_experts(logits, top_k, **arguments, correction_bias=bias)
    h.require("weights dtype", h.backend.dtype_of(weights) == "float32", h.backend.dtype_of(weights))
    h.require("expert ids dtype", h.backend.dtype_of(ids) == "int32", h.backend.dtype_of(ids))
    h.equal("expert ids", h.host(ids).astype(np.int64), ref_ids)
    h.close("weights", weights, ref_weights)


def check_moe_experts(h: Harness, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int,
                      held: str = "all") -> None:
    """A quarter of the experts are chosen by no token; with more tokens than that leaves room for,
    others are chosen by several. `held` "middle": the weights hold only the middle half of the
    experts (a tensor-parallel rank's share, `first_expert` past 0), and the picks of the others,
    below and above it, add nothing."""
    x = h.rand(tokens, hidden)
    gate_up = h.rand(experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    down = h.rand(experts, hidden, intermediate, scale=intermediate**-0.5)
    share = range(experts) if held == "all" else range(experts // 4, experts - experts // 4)
    _check_experts(h, x, gate_up, down, top_k, gate_up, down, h.threshold, share)


def check_quantized_moe_experts(h: Harness, format: str, tokens: int, hidden: int, intermediate: int, experts: int,
                                top_k: int) -> None:
    """Experts still in a GGUF format, for a backend that keeps it for the experts role: the oracle
    multiplies by their dequantized values, as for a quantized `linear`."""
    if format not in h.backend.quantized_formats or WeightRole.EXPERTS not in h.backend.quantized_roles:
        raise OpNotSupported(h.backend.name, "moe_experts",
                             f"it keeps no {format} experts (quantized_formats, quantized_roles)")
    x = h.rand(tokens, hidden)
    gate_up = QuantizedTensor.stack([random_quantized(h.rng, format, 2 * intermediate, hidden) for _ in range(experts)])
    down = QuantizedTensor.stack([random_quantized(h.rng, format, hidden, intermediate) for _ in range(experts)])
    threshold = max(h.threshold, QUANTIZED_NMSE_THRESHOLDS[format])
    _check_experts(h, x, gate_up, down, top_k, gate_up.dequantize(), down.dequantize(), threshold)


def _check_experts(h: Harness, x: np.ndarray, gate_up, down, top_k: int, gate_up_values: np.ndarray,
                   down_values: np.ndarray, threshold: float, share: range | None = None) -> None:
    """Routing over all of `gate_up`'s experts, the op given only those of `share` (all by default)."""
    tokens, experts = x.shape[0], gate_up.shape[0]
    share = share or range(experts)
    available = h.rng.choice(experts, experts - experts // 4, replace=False)
    ids = np.stack([h.rng.choice(available, top_k, replace=False) for _ in range(tokens)])
    weights = h.rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    out = h.call(h.backend.ops.moe_experts, h.upload(x), h.upload(weights, "float32"), h.upload(ids),
                 h.upload_weight("experts.gate_up_proj", WeightRole.EXPERTS, take_experts(gate_up, share)),
                 h.upload_weight("experts.down_proj", WeightRole.EXPERTS, take_experts(down, share)),
                 first_expert=share.start)
    h.require("output dtype", h.backend.dtype_of(out) == h.dtype, h.backend.dtype_of(out))
    h.close("out", out, oracle.moe_experts(x, weights, ids, gate_up_values[share.start : share.stop],
                                           down_values[share.start : share.stop], lambda a: round_to(a, h.dtype),
                                           first_expert=share.start), threshold=threshold)


def check_memory(h: Harness, shape: tuple) -> None:
    """to_device, to_host, dtype_of and zeros: values round trip at the case's dtype, float64 arrays
    are rounded to it, integer arrays stay integers."""
    values = h.rand(*shape)
    tensor = h.backend.to_device(values, h.dtype)
    h.require("dtype_of(to_device(array, dtype))", h.backend.dtype_of(tensor) == h.dtype, h.backend.dtype_of(tensor))
    back = h.backend.to_host(tensor)
    h.require("to_host gives a numpy array", isinstance(back, np.ndarray), type(back).__name__)
    h.equal("to_host(to_device(array, dtype))", np.asarray(back, dtype=np.float32), values)
    wide = h.rng.standard_normal(shape)
    h.equal("to_device(float64 array, dtype)", np.asarray(h.backend.to_host(h.backend.to_device(wide, h.dtype)),
                                                         dtype=np.float32), round_to(wide, h.dtype))
    integers = h.rng.integers(-(2**20), 2**20, shape).astype(np.int32)
    held = h.backend.to_device(integers)
    h.require("dtype_of(to_device(int32 array))", h.backend.dtype_of(held) in ("int32", "int64"),
              h.backend.dtype_of(held))
    h.equal("to_host(to_device(int32 array))", np.asarray(h.backend.to_host(held)).astype(np.int32), integers)
    zeros = h.backend.zeros(shape, h.dtype)
    h.require("dtype_of(zeros(shape, dtype))", h.backend.dtype_of(zeros) == h.dtype, h.backend.dtype_of(zeros))
    h.equal("zeros(shape, dtype)", np.asarray(h.backend.to_host(zeros), dtype=np.float32), np.zeros(shape, np.float32))


def check_allocate_kv_cache(h: Harness, layers: int, block_size: int, kv_heads: int, head_dim: int,
                            value_dim: int | None = None, kv_dtype: str | None = None) -> None:
    """value_dim: the values' width where it is not head_dim (a latent cache). kv_dtype: a quantized
    cache's, when not the compute dtype: its parts are bytes, each row 4 wider for its scale."""
    spec = KVCacheSpec(layers, 7, block_size, kv_heads, head_dim, kv_dtype or h.dtype, value_dim)
    caches = h.backend.allocate_kv_cache(spec)
    h.require("layers", len(caches) == layers, f"{len(caches)} caches for {layers} layers")
    for layer, cache in enumerate(caches):
        for name, part, shape in (("key", cache.key, spec.block_shape), ("value", cache.value, spec.value_block_shape)):
            h.require(f"layer {layer} {name} shape", tuple(part.shape) == shape, f"{tuple(part.shape)}, not {shape}")
            h.require(f"layer {layer} dtype", h.backend.dtype_of(part) == spec.storage_dtype, h.backend.dtype_of(part))


def check_copy_blocks(h: Harness, layers: int, block_size: int, copies: int, latent: bool = False,
                      kv_dtype: str | None = None) -> None:
    """With `latent`, a latent cache's blocks (one head, values wider than keys). kv_dtype: a quantized
    cache's, when not the compute dtype (its blocks are bytes, copied as they are)."""
    kv_dtype = kv_dtype or h.dtype
    shape = (2 * copies + 3, block_size, 1 if latent else 2, 64)
    value_shape = (*shape[:3], 256) if latent else shape
    host = [(_stored(h.rand(*shape), kv_dtype), _stored(h.rand(*value_shape), kv_dtype)) for _ in range(layers)]
    picked = h.rng.permutation(shape[0])[: 2 * copies]
    mapping = np.stack([picked[:copies], picked[copies:]], axis=1)
    caches = h.backend.copy_blocks([h.upload_cache(k, v, kv_dtype) for k, v in host], mapping)
    for layer, (key, value) in enumerate(host):
        key, value = key.copy(), value.copy()
        key[mapping[:, 1]], value[mapping[:, 1]] = key[mapping[:, 0]], value[mapping[:, 0]]
        h.equal(f"layer {layer} key", h.host(caches[layer].key), key)
        h.equal(f"layer {layer} value", h.host(caches[layer].value), value)


def _swap_setup(h: Harness, layers: int, block_size: int, blocks: int, latent: bool, kv_dtype: str | None = None):
    """Device caches of random blocks, some of them (`out_ids`) to go to `host_ids` of a new swap space;
    with `latent`, a latent cache's (one head, values wider than keys); in `kv_dtype` where given."""
    kv_dtype = kv_dtype or h.dtype
    device_blocks, host_blocks = 2 * blocks + 2, blocks + 3
    spec = (KVCacheSpec(layers, host_blocks, block_size, 1, 64, kv_dtype, 256) if latent
            else KVCacheSpec(layers, host_blocks, block_size, 2, 64, kv_dtype))
    key_shape, value_shape = (device_blocks, *spec.block_shape[1:]), (device_blocks, *spec.value_block_shape[1:])
    if spec.quantized:  # rows of values, stored as bytes 4 wider
        key_shape, value_shape = (*key_shape[:3], spec.head_dim), (*value_shape[:3], spec.value_dim)
    host = [(_stored(h.rand(*key_shape), kv_dtype), _stored(h.rand(*value_shape), kv_dtype)) for _ in range(layers)]
    caches = [h.upload_cache(k, v, kv_dtype) for k, v in host]
    device_ids = h.rng.permutation(device_blocks)
    out_ids, in_ids = device_ids[:blocks], device_ids[blocks: 2 * blocks]
    host_ids = h.rng.permutation(host_blocks)[:blocks]
    return spec, host, caches, out_ids, in_ids, host_ids


def _swap_space_errors(h: Harness, swap, host, out_ids, host_ids) -> list[str]:
    """What the swap space's `host_ids` blocks hold that differs from the device blocks `out_ids`."""
    if not isinstance(swap, (list, tuple)) or len(swap) != len(host) or not all(isinstance(s, KVCache) for s in swap):
        return [f"allocate_swap_space/swap_out gave {type(swap).__name__}, not a KVCache per layer"]
    errors = []
    for layer, ((key, value), space) in enumerate(zip(host, swap)):
        for part, expected, held in (("key", key, space.key), ("value", value, space.value)):
            held = np.asarray(held if isinstance(held, np.ndarray) else h.host(held), dtype=np.float32)
            if not np.array_equal(held[host_ids], expected[out_ids]):
                errors.append(f"layer {layer} {part}")
    return errors


def check_swap_out(h: Harness, layers: int, block_size: int, blocks: int, latent: bool = False,
                   kv_dtype: str | None = None) -> None:
    """Device blocks to host blocks: the swap space then holds them where the mapping says."""
    spec, host, caches, out_ids, _, host_ids = _swap_setup(h, layers, block_size, blocks, latent, kv_dtype)
    swap = h.backend.swap_out(caches, h.backend.allocate_swap_space(spec), np.stack([out_ids, host_ids], axis=1))
    for where in _swap_space_errors(h, swap, host, out_ids, host_ids):
        h.require(f"swap space {where}", False, f"swap_out did not copy device blocks {_listed(out_ids)} to host "
                                               f"blocks {_listed(host_ids)}")


def check_swap_in(h: Harness, layers: int, block_size: int, blocks: int, latent: bool = False,
                  kv_dtype: str | None = None) -> None:
    """Host blocks back to other device blocks, after a swap_out that filled them; only the
    mapped device blocks change."""
    spec, host, caches, out_ids, in_ids, host_ids = _swap_setup(h, layers, block_size, blocks, latent, kv_dtype)
    swap = h.backend.swap_out(caches, h.backend.allocate_swap_space(spec), np.stack([out_ids, host_ids], axis=1))
    if _swap_space_errors(h, swap, host, out_ids, host_ids):
        h.require("swap_in not checked", False, "swap_out did not fill the swap space it reads (the swap_out "
                                                "cases say how)")
        return
    caches = h.backend.swap_in(caches, swap, np.stack([host_ids, in_ids], axis=1))
    for layer, (key, value) in enumerate(host):
        key, value = key.copy(), value.copy()
        key[in_ids], value[in_ids] = key[out_ids], value[out_ids]
        for part, expected, got in (("key", key, caches[layer].key), ("value", value, caches[layer].value)):
            got = h.host(got)
            if not np.array_equal(got, expected):
                differ = np.flatnonzero(np.any((got != expected).reshape(len(got), -1), axis=1))
                h.require(f"layer {layer} {part}", False,
                          f"device blocks {_listed(differ)} differ after swap_in from host blocks "
                          f"{_listed(host_ids)} to device blocks {_listed(in_ids)}")


def _listed(ids) -> str:
    return "[" + ", ".join(str(int(i)) for i in ids) + "]"


def check_array_subset(h: Harness, shape: tuple) -> None:
    """The array methods model graphs may use directly (see candelabra.core.contract.ops)."""
    a, b = h.rand(*shape), h.rand(*shape)
    x, y = h.upload(a), h.upload(b)
    h.require("shape", tuple(x.shape) == shape, f"{tuple(x.shape)}")
    h.equal("reshape", h.host(x.reshape(shape[0] * shape[1], -1)), a.reshape(shape[0] * shape[1], -1))
    for name, view, expected in [
        ("x[i]", x[1], a[1]), ("x[a:b]", x[1:3], a[1:3]),
        ("x[:, a:b]", x[:, 2:5], a[:, 2:5]), ("x[..., a:b]", x[..., 3:7], a[..., 3:7]),
    ]:
        h.equal(name, h.host(view), expected)
    for name, result, expected in [
        ("x + y", x + y, round_to(a.astype(np.float64) + b, h.dtype)),
        ("x * y", x * y, round_to(a.astype(np.float64) * b, h.dtype)),
        ("x * 0.5", x * 0.5, round_to(a * 0.5, h.dtype)),
        ("x + 1.5", x + 1.5, round_to(a.astype(np.float64) + 1.5, h.dtype)),
    ]:
        h.require(f"{name} dtype", h.backend.dtype_of(result) == h.dtype, h.backend.dtype_of(result))
        h.close(name, result, expected)


def _grid(op: str, check, dtypes, **axes) -> list[Case]:
    names = list(axes)
    return [
        Case(op, dtype, tuple(zip(names, values)), check)
        for dtype in dtypes
        for values in itertools.product(*axes.values())
    ]


def _kv_dtype_grid(op: str, check, dtypes, kv_cache_dtypes, **axes) -> list[Case]:
    """`_grid` at every KV cache dtype the backend declares beside each compute dtype, other than
    the compute dtype itself (which the plain grid covers)."""
    return [case for dtype in dtypes for kv_dtype in kv_cache_dtypes(dtype) if kv_dtype != dtype
            for case in _grid(op, check, (dtype,), kv_dtype=[kv_dtype], **axes)]


def _quantized_kv_grid(op: str, check, dtypes, kv_cache_dtypes, **axes) -> list[Case]:
    """`_grid` at every quantized KV cache dtype the backend declares beside each compute dtype."""
    return [case for dtype in dtypes for kv_dtype in kv_cache_dtypes(dtype) if kv_dtype in QUANTIZED_KV_DTYPES
            for case in _grid(op, check, (dtype,), kv_dtype=[kv_dtype], **axes)]


# Quantized experts are multiplied by the kernels of quantized linear weights, whose cases cover every
# format: these cover each kind of form a backend may keep them in (int8 rows, int4 groups from a legacy
# and from a K format, K-format blocks, a GPTQ or AWQ checkpoint's int4 groups).
EXPERT_FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "INT4_G128")


def _quantized_grid(op: str, check, dtypes, formats=GGUF_QUANTIZED_FORMATS, **axes) -> list[Case]:
    """Cases of `op` with its weights quantized, one format each, reported apart from the dense ones."""
    return [
        Case(op, case.dtype, case.params, case.check, weight_format=dict(case.params)["format"])
        for format in formats
        for case in _grid(op, check, dtypes, format=[format], **axes)
    ]


def _quantized_linear_grid(dtypes, formats=GGUF_QUANTIZED_FORMATS, **axes) -> list[Case]:
    return _quantized_grid("linear", check_quantized_linear, dtypes, formats, **axes)


def op_cases(dtypes: tuple[str, ...], kv_cache_dtypes: Callable[[str], tuple[str, ...]] | None = None) -> list[Case]:
    """The whole level-1 grid for a backend computing in `dtypes`, keeping its KV cache in the
    dtypes `kv_cache_dtypes(compute dtype)` gives (`Backend.kv_cache_dtypes`; default: the compute
    dtype alone)."""
    attention_heads = [(4, 4), (16, 4), (16, 2)]  # GQA ratios 1, 4 and 8
    kv_cache_dtypes = kv_cache_dtypes or (lambda dtype: (dtype,))
    return [
        *_grid("embedding", check_embedding, dtypes, vocab=[1000], hidden=[256], tokens=[17], scaled=[False, True]),
        *_grid("embedding", check_embedding, dtypes, vocab=[32000], hidden=[896], tokens=[5], scaled=[True]),
        # 2 and 3 rows: decode batches of a few requests, which backends may special-case.
        *_grid("linear", check_linear, dtypes, tokens=[1, 2, 3, 7, 128], in_features=[896], out_features=[1152],
               bias=[False, True]),
        *_grid("linear", check_linear, dtypes, tokens=[33], in_features=[2048], out_features=[256], bias=[False]),
        *_grid("linear", check_linear, dtypes, tokens=[2], in_features=[896], out_features=[4000], bias=[False],
               role=["lm_head"]),
        # In features a multiple of 256, as the K formats need (models whose widths are not get
        # those tensors in other formats).
        *_quantized_linear_grid(dtypes, tokens=[1, 5], in_features=[512], out_features=[384], bias=[True]),
        *_quantized_linear_grid(dtypes, tokens=[3], in_features=[768], out_features=[1000], bias=[False],
                                role=["lm_head"]),
        # GPTQ's and AWQ's int4 groups, and once with the columns stored in act order.
        *_quantized_linear_grid(dtypes, INT4_GROUP_FORMATS, tokens=[1, 5], in_features=[512], out_features=[384],
                                bias=[True]),
        *_quantized_linear_grid(dtypes, ["INT4_G128"], tokens=[3], in_features=[1024], out_features=[256],
                                bias=[False], column_order=[True]),
        *_grid("gather_rows", check_gather_rows, dtypes, tokens=[1, 37, 300], hidden=[896], picked=[1, 8, 40]),
        *_grid("gather_rows", check_gather_rows, dtypes, tokens=[5], hidden=[151936], picked=[7]),
        *_grid("rms_norm", check_rms_norm, dtypes, shape=[(1, 896), (37, 2048), (9, 8, 128)],
               weight_offset=[0.0, 1.0]),
        *_grid("add_rms_norm", check_add_rms_norm, dtypes, shape=[(1, 896), (21, 2560)], weight_offset=[0.0, 1.0]),
        *_grid("layer_norm", check_layer_norm, dtypes, shape=[(1, 2560), (19, 640)], bias=[False, True]),
        *_grid("rotary", check_rotary, dtypes, tokens=[13], heads=[(8, 2)], head_dim=[64, 128, 256],
               rotary_dim=[None], style=["neox", "gptj"], scaling=["default"]),
        *_grid("rotary", check_rotary, dtypes, tokens=[5], heads=[(4, 4)], head_dim=[80], rotary_dim=[32],
               style=["neox", "gptj"], scaling=["default"]),
        *_grid("rotary", check_rotary, dtypes, tokens=[11], heads=[(16, 8)], head_dim=[128], rotary_dim=[None],
               style=["neox"], scaling=["linear", "llama3", "yarn"]),
        *_grid("silu_and_mul", check_silu_and_mul, dtypes, tokens=[1, 23], intermediate=[4864]),
        *_grid("gelu_and_mul", check_gelu_and_mul, dtypes, tokens=[1, 23], intermediate=[2048],
               approximate=["none", "tanh"]),
        *_grid("gelu", check_gelu, dtypes, shape=[(3, 1000), (17, 10240)], approximate=["none", "tanh"]),
        # one row, a decode's (which a backend may fuse into a GEMV), and a few
        *_grid("gated_linear", check_gated_linear, dtypes, tokens=[1, 3], intermediate=[1024], out_features=[896],
               activation=["silu", "gelu", "gelu_tanh"], bias=[False]),
        *_grid("gated_linear", check_gated_linear, dtypes, tokens=[1], intermediate=[2816], out_features=[640],
               activation=["silu"], bias=[True]),
        *_quantized_grid("gated_linear", check_gated_linear, dtypes, ["Q4_K"], tokens=[1, 5],
                         intermediate=[1024], out_features=[384], activation=["silu"], bias=[False]),
        # one row, a decode's (which a backend may fuse into a GEMV), and a few; the first layer's without a
        # residual, Gemma's norm weights stored less one
        *_grid("rms_norm_linear", check_rms_norm_linear, dtypes, tokens=[1, 4], hidden=[1024], out_features=[768],
               residual=[True, False], weight_offset=[0.0], bias=[False]),
        *_grid("rms_norm_linear", check_rms_norm_linear, dtypes, tokens=[1], hidden=[2560], out_features=[640],
               residual=[True], weight_offset=[1.0], bias=[True]),
        *_quantized_grid("rms_norm_linear", check_rms_norm_linear, dtypes, ["Q4_K"], tokens=[1, 5], hidden=[1024],
                         out_features=[384], residual=[True], weight_offset=[0.0], bias=[False]),
        # one row, a decode's (which a backend may fuse into two GEMVs), and a few; the first layer's without a
        # residual
        *_grid("rms_norm_gated_mlp", check_rms_norm_gated_mlp, dtypes, tokens=[1, 3], hidden=[1024],
               intermediate=[1408], residual=[True], activation=["silu", "gelu_tanh"], bias=[False]),
        *_grid("rms_norm_gated_mlp", check_rms_norm_gated_mlp, dtypes, tokens=[1], hidden=[768], intermediate=[2048],
               residual=[False], activation=["gelu"], bias=[True]),
        *_quantized_grid("rms_norm_gated_mlp", check_rms_norm_gated_mlp, dtypes, ["Q4_K"], tokens=[1, 5],
                         hidden=[512], intermediate=[768], residual=[True], activation=["silu"], bias=[False]),
        *_grid("write_kv", check_write_kv, dtypes, block_size=[16, 32], kv_heads=[2, 8], head_dim=[128],
               tokens=[1, 70], padding=["none", "some"]),
        *_grid("write_kv", check_write_kv, dtypes, block_size=[16], kv_heads=[2], head_dim=[64], tokens=[5],
               padding=["all"]),
        *_grid("write_kv", check_write_kv, dtypes, block_size=[16], kv_heads=[1], head_dim=[64], tokens=[37],
               padding=["some"], value_dim=[512]),
        *_grid("rotary_and_write_kv", check_rotary_and_write_kv, dtypes, tokens=[1, 37], heads=[(8, 2)],
               head_dim=[64, 128], block_size=[16], style=["neox", "gptj"], padding=["none", "some"]),
        # multi-head latent attention's: the shared rotary key as the key, the latent as the value
        *_grid("rotary_and_write_kv", check_rotary_and_write_kv, dtypes, tokens=[1, 37], heads=[(16, 1)],
               head_dim=[64], block_size=[16], style=["gptj"], padding=["some"], value_dim=[512]),
        # decodes alone, which a backend may fuse into one launch, and a mixed step; partial rotary, GPT-J's pairs
        *_grid("rotary_and_paged_attention", check_rotary_and_paged_attention, dtypes, head_dim=[128],
               heads=[(16, 4)], block_size=[16], batch=["decode", "mixed"], style=["neox"], padded=[0, 3]),
        *_grid("rotary_and_paged_attention", check_rotary_and_paged_attention, dtypes, head_dim=[64], heads=[(8, 2)],
               block_size=[32], batch=["decode"], style=["gptj", "neox"], rotary_dim=[32], sliding_window=[None, 40]),
        *_grid("paged_attention", check_paged_attention, dtypes, head_dim=[64, 128, 256], heads=attention_heads,
               block_size=[16, 32], batch=["mixed"]),
        *_grid("paged_attention", check_paged_attention, dtypes, head_dim=[128], heads=[(16, 4)], block_size=[16],
               batch=["decode", "prefill"]),
        *_grid("paged_attention", check_paged_attention, dtypes, head_dim=[64, 256], heads=[(8, 2)],
               block_size=[16, 32], batch=["mixed", "decode"], sliding_window=[24, 100]),
        *_grid("paged_attention", check_paged_attention, dtypes, head_dim=[128], heads=[(8, 4)], block_size=[16],
               batch=["mixed", "decode"], logit_softcap=[2.0]),
        *_grid("paged_attention", check_paged_attention, dtypes, head_dim=[256], heads=[(8, 4)], block_size=[32],
               batch=["mixed"], sliding_window=[40], logit_softcap=[5.0]),
        *_grid("paged_latent_attention", check_paged_latent_attention, dtypes, heads=[16], rank=[512],
               rope_dim=[64], block_size=[16], batch=["mixed", "decode"]),
        *_grid("paged_latent_attention", check_paged_latent_attention, dtypes, heads=[4], rank=[128],
               rope_dim=[32], block_size=[32], batch=["prefill"]),
        *_grid("per_head_linear", check_per_head_linear, dtypes, tokens=[1, 37], heads=[16], in_features=[128],
               out_features=[512]),
        *_grid("per_head_linear", check_per_head_linear, dtypes, tokens=[5], heads=[4], in_features=[512],
               out_features=[128]),
        *_kv_dtype_grid("write_kv", check_write_kv, dtypes, kv_cache_dtypes, block_size=[16], kv_heads=[2],
                        head_dim=[128], tokens=[70], padding=["some"]),
        *_kv_dtype_grid("paged_attention", check_paged_attention, dtypes, kv_cache_dtypes, head_dim=[128],
                        heads=[(16, 4)], block_size=[16], batch=["mixed", "decode"]),
        *_kv_dtype_grid("paged_attention", check_paged_attention, dtypes, kv_cache_dtypes, head_dim=[256],
                        heads=[(8, 4)], block_size=[32], batch=["mixed"], sliding_window=[40], logit_softcap=[5.0]),
        # A quantized cache through every other call that writes, reads or moves its rows.
        *_quantized_kv_grid("write_kv", check_write_kv, dtypes, kv_cache_dtypes, block_size=[16], kv_heads=[1],
                            head_dim=[64], tokens=[37], padding=["some"], value_dim=[512]),
        *_quantized_kv_grid("rotary_and_write_kv", check_rotary_and_write_kv, dtypes, kv_cache_dtypes, tokens=[37],
                            heads=[(8, 2)], head_dim=[128], block_size=[16], style=["neox"], padding=["some"]),
        *_quantized_kv_grid("rotary_and_write_kv", check_rotary_and_write_kv, dtypes, kv_cache_dtypes, tokens=[37],
                            heads=[(16, 1)], head_dim=[64], block_size=[16], style=["gptj"], padding=["some"],
                            value_dim=[512]),
        *_quantized_kv_grid("paged_latent_attention", check_paged_latent_attention, dtypes, kv_cache_dtypes,
                            heads=[16], rank=[512], rope_dim=[64], block_size=[16], batch=["mixed"]),
        *_quantized_kv_grid("allocate_kv_cache", check_allocate_kv_cache, dtypes, kv_cache_dtypes, layers=[2],
                            block_size=[16], kv_heads=[2], head_dim=[128]),
        *_quantized_kv_grid("copy_blocks", check_copy_blocks, dtypes, kv_cache_dtypes, layers=[2], block_size=[16],
                            copies=[3]),
        *_quantized_kv_grid("swap_out", check_swap_out, dtypes, kv_cache_dtypes, layers=[2], block_size=[16],
                            blocks=[3], latent=[False, True]),
        *_quantized_kv_grid("swap_in", check_swap_in, dtypes, kv_cache_dtypes, layers=[2], block_size=[16],
                            blocks=[3]),
        *_grid("softcap", check_softcap, dtypes, shape=[(4, 32000), (64, 256)], cap=[30.0]),
        *_grid("softmax", check_softmax, dtypes, shape=[(8, 1000), (3, 5, 311)], magnitude=["normal", "large"]),
        *_grid("sample", check_sample, dtypes, rows=[8], vocab=[1000], mode=SAMPLING_MODES, logprobs=[0, 5]),
        *_grid("sample", check_sample, dtypes, rows=[6], vocab=[32000], mode=["combined", "penalties", "allowed"],
               logprobs=[20]),
        *_grid("sample", check_sample, dtypes, rows=[3], vocab=[151936], mode=["greedy", "combined"], logprobs=[1]),
        *_grid("sample", check_sample, dtypes, rows=[8], vocab=[1000], mode=["greedy", "top_k", "combined"],
               logprobs=[5], tied=[True]),
        *_grid("token_logprobs", check_token_logprobs, dtypes, rows=[1, 9], vocab=[1000], num_top=[0, 5]),
        *_grid("token_logprobs", check_token_logprobs, dtypes, rows=[4], vocab=[151936], num_top=[20]),
        *_grid("token_logprobs", check_token_logprobs, dtypes, rows=[7], vocab=[1000], num_top=[3], tied=[True]),
        *_grid("route_experts", check_route_experts, dtypes, tokens=[1, 33], experts=[8], top_k=[2],
               routing=["softmax"]),
        *_grid("route_experts", check_route_experts, dtypes, tokens=[5], experts=[64], top_k=[6],
               routing=list(ROUTINGS)),
        *_grid("route_experts", check_route_experts, dtypes, tokens=[33], experts=[64], top_k=[6],
               routing=["deepseek_v3"]),
        *_grid("moe_experts", check_moe_experts, dtypes, tokens=[1, 5, 33], hidden=[64], intermediate=[32],
               experts=[8], top_k=[2]),
        *_grid("moe_experts", check_moe_experts, dtypes, tokens=[1, 33], hidden=[256], intermediate=[128],
               experts=[16], top_k=[4]),
        *_grid("moe_experts", check_moe_experts, dtypes, tokens=[33], hidden=[64], intermediate=[32],
               experts=[8], top_k=[2], held=["middle"]),
        # Widths of whole K-format blocks, as for quantized linear.
        *_quantized_grid("moe_experts", check_quantized_moe_experts, dtypes, EXPERT_FORMATS, tokens=[5],
                         hidden=[256], intermediate=[256], experts=[4], top_k=[2]),
        *_grid("memory", check_memory, dtypes, shape=[(3, 5, 7)]),
        *_grid("allocate_kv_cache", check_allocate_kv_cache, dtypes, layers=[3], block_size=[16, 32], kv_heads=[2],
               head_dim=[128]),
        *_grid("allocate_kv_cache", check_allocate_kv_cache, dtypes, layers=[2], block_size=[16], kv_heads=[1],
               head_dim=[64], value_dim=[512]),
        *_grid("copy_blocks", check_copy_blocks, dtypes, layers=[2], block_size=[16, 32], copies=[1, 5]),
        *_grid("copy_blocks", check_copy_blocks, dtypes, layers=[2], block_size=[16], copies=[3], latent=[True]),
        *_grid("swap_out", check_swap_out, dtypes, layers=[2], block_size=[16, 32], blocks=[1, 4]),
        *_grid("swap_out", check_swap_out, dtypes, layers=[2], block_size=[16], blocks=[3], latent=[True]),
        *_grid("swap_in", check_swap_in, dtypes, layers=[2], block_size=[16, 32], blocks=[1, 4]),
        *_grid("swap_in", check_swap_in, dtypes, layers=[2], block_size=[16], blocks=[3], latent=[True]),
        *_grid("array_subset", check_array_subset, dtypes, shape=[(4, 6, 8)]),
    ]


# The ops level's op names beyond the contract's ops, and the calls each checks.
CONTRACT_CALL_CASES = {
    "memory": "Backend.to_device, to_host, dtype_of and zeros: values and dtypes round trip",
    "allocate_kv_cache": "Backend.allocate_kv_cache: one KVCache per layer, of the spec's shape and dtype",
    "copy_blocks": "Backend.copy_blocks: whole blocks within the device cache",
    "swap_out": "Backend.allocate_swap_space and swap_out: device blocks to the host swap space",
    "swap_in": "Backend.swap_in: host blocks back to device blocks (after a swap_out that filled them)",
    "array_subset": "the tensor methods model graphs use: reshape, indexing and slicing, + and * (ops module)",
}


def op_names() -> list[str]:
    """Every op name `--op` takes, in the order the level runs them."""
    return list(dict.fromkeys(case.op for case in op_cases(("float32",))))


def op_listing() -> str:
    """Every op name `--op` takes, with what its cases check."""
    return "\n".join(f"{name:<20} {CONTRACT_CALL_CASES.get(name, f'Ops.{name}')}" for name in op_names())
