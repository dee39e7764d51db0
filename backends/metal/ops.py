"""The ops in MLX. Everything stays lazy: an op adds to the step's graph, and the graph is
computed once, when the model runner evaluates the step."""

from __future__ import annotations

import math

import mlx.core as mx

from candelabra.backends.metal import attention, sampling
from candelabra.backends.metal.quantized import MlxInt4Weight
from candelabra.core.contract.ops import KVCache, Ops, check_experts_shapes, check_routing

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)

# From this many picks (tokens times experts per token) on, moe_experts sorts them by expert first,
# so that gather_mm reads each expert's weights once for a run of rows (mlx-lm's SwitchGLU does the same).
SORTED_PICKS_MIN = 64


def _f32(x):
    return x.astype(mx.float32)


class MlxOps(Ops):
    backend_name = "metal"

    def embedding(self, ids, table, scale=None):
        rows = table[ids]
        return (_f32(rows) * scale).astype(table.dtype) if scale is not None else rows

    def gather_rows(self, x, rows):
        return x[rows]

    def linear(self, x, weight, bias=None):
        if isinstance(weight, MlxInt4Weight):
            out = weight.matmul(x)
            return out if bias is None else out + bias
        if bias is None:
            return x @ weight.T
        return mx.addmm(bias, x, weight.T)

    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        # In float32 throughout, rounded once at the end: MLX's fused kernel on a bfloat16 x rounds the
        # normalised x before it scales it (NMSE 1e-5 against the result rounded once, where 1e-9 is
        # right). The offset is added in float32 too (Gemma's 1 + w would lose bits in bfloat16).
        scale = _f32(weight) + weight_offset if weight_offset else _f32(weight)
        return mx.fast.rms_norm(_f32(x), scale, eps).astype(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps, weight_offset=0.0):
        summed = x + residual
        return self.rms_norm(summed, weight, eps, weight_offset), summed

    def layer_norm(self, x, weight, bias, eps):
        # In float32 and rounded once, as rms_norm.
        out = mx.fast.layer_norm(_f32(x), _f32(weight), None if bias is None else _f32(bias), eps)
        return out.astype(x.dtype)

    def rotary(self, q, k, positions, cos_sin, style="neox"):
        # mx.fast.rope computes angles in float32 on the fly (NMSE 5e-9 at position 16k, 4e-7
        # at 128k against float64); gathering the float64-built table keeps full accuracy.
        half = cos_sin.shape[1] // 2
        rows = cos_sin[positions]
        cos, sin = rows[:, None, :half], rows[:, None, half:]
        return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)

    def silu_and_mul(self, x):
        gate, up = mx.split(_f32(x), 2, axis=-1)
        return (gate * mx.sigmoid(gate) * up).astype(x.dtype)

    def gelu_and_mul(self, x, approximate="none"):
        gate, up = mx.split(_f32(x), 2, axis=-1)
        return (_gelu(gate, approximate) * up).astype(x.dtype)

    def gelu(self, x, approximate="none"):
        return _gelu(_f32(x), approximate).astype(x.dtype)

    def write_kv(self, cache, key, value, slot_mapping):
        # A slot of -1 writes nothing, but a scatter cannot drop rows without a data-dependent
        # shape: such rows rewrite the first real token's row with that token's own data, or,
        # if no token is real, slot 0 with what it already holds. Identical duplicate writes
        # are harmless in any order.
        key_rows = cache.key.reshape(-1, *cache.key.shape[2:])
        value_rows = cache.value.reshape(-1, *cache.value.shape[2:])
        real = slot_mapping >= 0
        first_real = mx.argmax(real.astype(mx.int32))
        any_real = mx.any(real)
        fallback_slot = mx.where(any_real, slot_mapping[first_real], 0)
        slots = mx.where(real, slot_mapping, fallback_slot)
        real = real[:, None, None]
        key_fill = mx.where(any_real, key[first_real], key_rows[0])
        value_fill = mx.where(any_real, value[first_real], value_rows[0])
        key_rows[slots] = mx.where(real, key, key_fill).astype(key_rows.dtype)
        value_rows[slots] = mx.where(real, value, value_fill).astype(value_rows.dtype)
        return KVCache(key_rows.reshape(cache.key.shape), value_rows.reshape(cache.value.shape))

    def paged_attention(self, q, cache, step, scale, sliding_window=None, logit_softcap=None):
        return attention.paged_attention(q, cache, step, scale, sliding_window, logit_softcap)

    def softcap(self, x, cap):
        return (mx.tanh(_f32(x) / cap) * cap).astype(x.dtype)

    def softmax(self, x):
        return mx.softmax(x, axis=-1, precise=True)

    def sample(self, logits, params):
        return sampling.sample(logits, params)

    def token_logprobs(self, logits, token_ids, num_top: int):
        return sampling.token_logprobs(logits, token_ids, num_top)

    def route_experts(self, router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                      top_groups=1, group_scoring="max", correction_bias=None):
        check_routing(router_logits.shape[-1], top_k, scoring, num_groups, top_groups, group_scoring)
        logits = _f32(router_logits)
        scores = mx.softmax(logits, axis=-1, precise=True) if scoring == "softmax" else mx.sigmoid(logits)
        choice = scores + _f32(correction_bias) if correction_bias is not None else scores
        if num_groups > 1:
            choice = _keep_best_groups(choice, num_groups, top_groups, group_scoring)
        expert_ids = _best_first(choice)[:, :top_k]
        weights = mx.take_along_axis(scores, expert_ids, axis=-1)
        if renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * scale, expert_ids.astype(mx.int32)

    def per_head_linear(self, x, weight):
        return (x.swapaxes(0, 1) @ weight.swapaxes(-1, -2)).swapaxes(0, 1)

    def paged_latent_attention(self, q_latent, q_rope, cache, step, scale):
        return attention.paged_latent_attention(q_latent, q_rope, cache, step, scale)

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        check_experts_shapes(x, weights, expert_ids, gate_up, down, first_expert)
        expert_ids, weights = _held_picks(expert_ids, weights, first_expert, gate_up.shape[0])
        tokens, top_k = expert_ids.shape
        if tokens * top_k < SORTED_PICKS_MIN:
            rows, experts = mx.expand_dims(x, (-2, -3)), expert_ids  # [T, 1, 1, H] against [T, K]
            expert_out = self._experts_mlp(rows, experts, gate_up, down, sorted_indices=False).squeeze(-2)
        else:
            picked = expert_ids.reshape(-1)
            order = mx.argsort(picked)
            rows = mx.expand_dims(x[order // top_k], -2)  # [T * K, 1, H], grouped by expert
            expert_out = self._experts_mlp(rows, picked[order], gate_up, down, sorted_indices=True)
            expert_out = expert_out.squeeze(-2)[mx.argsort(order)].reshape(tokens, top_k, -1)
        return (_f32(expert_out) * _f32(weights)[..., None]).sum(axis=1).astype(x.dtype)

    def _experts_mlp(self, rows, experts, gate_up, down, sorted_indices):
        gated = _gather_mm(rows, gate_up.swapaxes(-1, -2), experts, sorted_indices)
        return _gather_mm(self.silu_and_mul(gated), down.swapaxes(-1, -2), experts, sorted_indices)


def _held_picks(expert_ids, weights, first_expert, held):
    """The picks as indices into the `held` experts from `first_expert` on, and their weights; a pick
    of an expert not held becomes one of expert 0 at weight 0 (knowing which are held would mean
    reading the ids back, which would end the lazy graph)."""
    local = expert_ids - first_expert
    inside = (local >= 0) & (local < held)
    return mx.where(inside, local, 0), mx.where(inside, weights, 0)


def _gather_mm(a, b, rhs_indices, sorted_indices):
    """mx.gather_mm, in the inputs' dtype. MLX's CPU build multiplies only float32 there, so it gets
    float32 copies and its product is rounded back, as the GPU's native product is."""
    if a.dtype == mx.float32 or mx.metal.is_available():
        return mx.gather_mm(a, b, rhs_indices=rhs_indices, sorted_indices=sorted_indices)
    return mx.gather_mm(_f32(a), _f32(b), rhs_indices=rhs_indices, sorted_indices=sorted_indices).astype(a.dtype)


def _best_first(values):
    """Column indices of each row of float32 `values` by decreasing value, equal values in increasing
    index order: mx.argsort promises no order among equals, so each value's order-preserving
    integer and its index form one key."""
    bits = values.view(mx.int32)
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)
    columns = values.shape[-1]
    return mx.argsort(-ordered * columns + mx.arange(columns, dtype=mx.int64), axis=-1)


def _keep_best_groups(choice, num_groups, top_groups, group_scoring):
    """`choice` [T, E] with every expert outside its row's top_groups best groups at -inf."""
    grouped = choice.reshape(choice.shape[0], num_groups, -1)
    if group_scoring == "max":
        group_scores = grouped.max(axis=-1)
    else:
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)
    best = _best_first(group_scores)[:, :top_groups]
    kept = (mx.arange(num_groups)[None, None, :] == best[:, :, None]).any(axis=1)
    return mx.where(kept[..., None], grouped, -mx.inf).reshape(choice.shape)


def _gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _rotate(x, cos, sin, style):
    rotary_dim = 2 * cos.shape[-1]
    rotated, rest = _f32(x[..., :rotary_dim]), x[..., rotary_dim:]
    if style == "neox":
        a, b = rotated[..., : rotary_dim // 2], rotated[..., rotary_dim // 2 :]
        out = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    elif style == "gptj":
        pairs = rotated.reshape(*rotated.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rotated.shape)
    else:
        raise ValueError(f"unknown rotary style {style!r}; expected 'neox' or 'gptj'")
    out = out.astype(x.dtype)
    return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
