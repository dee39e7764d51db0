"""The numpy reference ops, in float32. Semantics are those of `candelabra.core.contract.ops.Ops`."""

from __future__ import annotations

import math

import numpy as np

from candelabra.backends.cpu import attention, sampling
from candelabra.core.contract.kv_quantization import quantize_kv_rows, storage_kv_dtype
from candelabra.core.contract.ops import (
    KVCache,
    Ops,
    SampleResult,
    TokenLogprobs,
    check_experts_shapes,
    check_routing,
)

_SQRT_2_OVER_PI = np.float32(math.sqrt(2 / math.pi))

# OpenBLAS multiplies one row by a weight as a matrix-vector product at memory speed, but two or
# three rows as a matrix-matrix product that first repacks the whole weight: 2.5x slower than two
# separate rows for a 4864 x 896 weight, 3.7x for the 151936 x 896 LM head. From four rows on the
# repacking pays for itself. Rows are therefore multiplied one by one up to this many.
ROW_BY_ROW_MAX = 3


class NumpyOps(Ops):
    backend_name = "cpu"

    def embedding(self, ids, table, scale=None):
        rows = table[ids]
        return rows * np.float32(scale) if scale is not None else rows

    def gather_rows(self, x, rows):
        return x[rows]

    def linear(self, x, weight, bias=None):
        if x.ndim == 2 and 1 < x.shape[0] <= ROW_BY_ROW_MAX:
            out = np.empty((x.shape[0], weight.shape[0]), dtype=np.result_type(x, weight))
            for row, out_row in zip(x, out):
                np.matmul(weight, row, out=out_row)
        else:
            out = x @ weight.T
        return out + bias if bias is not None else out

    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
        return x / np.sqrt(mean_square + np.float32(eps)) * (np.float32(weight_offset) + weight)

    def add_rms_norm(self, x, residual, weight, eps, weight_offset=0.0):
        summed = x + residual
        return self.rms_norm(summed, weight, eps, weight_offset), summed

    def layer_norm(self, x, weight, bias, eps):
        centred = x - x.mean(axis=-1, keepdims=True)
        variance = np.mean(np.square(centred), axis=-1, keepdims=True)
        out = centred / np.sqrt(variance + np.float32(eps)) * weight
        return out + bias if bias is not None else out

    def rotary(self, q, k, positions, cos_sin, style="neox"):
        half = cos_sin.shape[1] // 2
        cos = cos_sin[positions, :half][:, None, :]
        sin = cos_sin[positions, half:][:, None, :]
        return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)

    def silu_and_mul(self, x):
        gate, up = np.split(x, 2, axis=-1)
        return gate / (1 + np.exp(-gate)) * up

    def gelu_and_mul(self, x, approximate="none"):
        gate, up = np.split(x, 2, axis=-1)
        return self.gelu(gate, approximate) * up

    def gelu(self, x, approximate="none"):
        if approximate == "tanh":
            return 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x**3)))
        return (0.5 * x * (1 + _erf(x.astype(np.float64) / math.sqrt(2)))).astype(x.dtype)

    def write_kv(self, cache, key, value, slot_mapping):
        written = slot_mapping >= 0
        slots = slot_mapping[written]
        block_size = cache.key.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        for target, rows in ((cache.key, key[written]), (cache.value, value[written])):
            kv_dtype = storage_kv_dtype(str(target.dtype))
            target[blocks, offsets] = rows if kv_dtype is None else quantize_kv_rows(rows, kv_dtype)
        return cache

    def paged_attention(self, q, cache: KVCache, step, scale, sliding_window=None, logit_softcap=None):
        return attention.paged_attention(q, cache, step, scale, sliding_window, logit_softcap)

    def softcap(self, x, cap):
        return np.tanh(x / np.float32(cap)) * np.float32(cap)

    def softmax(self, x):
        shifted = np.exp(x - x.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)

    def sample(self, logits, params) -> SampleResult:
        return sampling.sample(logits, params)

    def token_logprobs(self, logits, token_ids, num_top: int) -> TokenLogprobs:
        return sampling.token_logprobs(logits, token_ids, num_top)

    def route_experts(self, router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                      top_groups=1, group_scoring="max", correction_bias=None):
        check_routing(router_logits.shape[-1], top_k, scoring, num_groups, top_groups, group_scoring)
        logits = router_logits.astype(np.float32)
        if scoring == "softmax":
            scores = NumpyOps.softmax(self, logits)  # the reference's own, whatever a subclass overrides
        else:
            with np.errstate(over="ignore"):
                scores = 1 / (1 + np.exp(-logits))
        choice = scores + correction_bias if correction_bias is not None else scores
        if num_groups > 1:
            choice = _keep_best_groups(choice, num_groups, top_groups, group_scoring)
        expert_ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(scores, expert_ids, axis=-1)
        if renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return weights * np.float32(scale), expert_ids.astype(np.int32)

    def per_head_linear(self, x, weight):
        out = np.matmul(x.transpose(1, 0, 2).astype(np.float32, copy=False),
                        weight.transpose(0, 2, 1).astype(np.float32, copy=False))
        return out.transpose(1, 0, 2).astype(x.dtype, copy=False)

    def paged_latent_attention(self, q_latent, q_rope, cache: KVCache, step, scale):
        return attention.paged_latent_attention(q_latent, q_rope, cache, step, scale)

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        check_experts_shapes(x, weights, expert_ids, gate_up, down, first_expert)
        picked = expert_ids.reshape(-1).astype(np.int64) - first_expert  # indices into the experts held
        token_of_pick = np.repeat(np.arange(x.shape[0]), expert_ids.shape[1])
        pick_weights = weights.reshape(-1, 1).astype(np.float32)
        out = np.zeros(x.shape, dtype=np.float32)
        for expert in np.unique(picked[(picked >= 0) & (picked < gate_up.shape[0])]):
            picks = np.flatnonzero(picked == expert)
            rows = token_of_pick[picks]
            # The reference's own linear and silu_and_mul, so that a subclass replacing one op leaves this one whole.
            activation = NumpyOps.silu_and_mul(self, NumpyOps.linear(self, x[rows], gate_up[expert]))
            np.add.at(out, rows, pick_weights[picks] * NumpyOps.linear(self, activation, down[expert]))
        return out.astype(x.dtype)


def _keep_best_groups(choice: np.ndarray, num_groups: int, top_groups: int, group_scoring: str) -> np.ndarray:
    """`choice` [T, E] with every expert outside its row's top_groups best groups at -inf."""
    grouped = choice.reshape(choice.shape[0], num_groups, -1)
    if group_scoring == "max":
        group_scores = grouped.max(axis=-1)
    else:
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :top_groups]
    kept = np.zeros(group_scores.shape, dtype=bool)
    np.put_along_axis(kept, best, True, axis=-1)
    return np.where(kept[..., None], grouped, -np.inf).reshape(choice.shape)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    rotary_dim = 2 * cos.shape[-1]
    if style == "neox":
        first, second = slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim)
    elif style == "gptj":
        first, second = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    else:
        raise ValueError(f"unknown rotary style {style!r}; expected 'neox' or 'gptj'")
    out = x.copy()
    a, b = x[..., first], x[..., second]
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to about 1e-7 absolute (Abramowitz and Stegun 7.1.26), in float64: numpy has none."""
    t = 1 / (1 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1 - poly * np.exp(-x * x))
