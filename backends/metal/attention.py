"""Paged attention in MLX over the step's gather layouts (see candelabra.core.contract.attention_layout).

Each group gathers its keys from the cache and runs one dense attention: MLX's fused
scaled_dot_product_attention, or the plain softmax form when logits are soft-capped, which the
fused kernel does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from candelabra.core.contract.attention_layout import GatheredStep, GatherGroup
from candelabra.core.contract.step_metadata import StepMetadata


@dataclass
class _Group:
    token_index: mx.array
    slots: mx.array
    key_pos: mx.array
    query_pos: mx.array
    valid: mx.array

    def visible(self, sliding_window):
        visible = self.valid & (self.key_pos <= self.query_pos)
        if sliding_window is not None:
            visible = visible & (self.key_pos > self.query_pos - sliding_window)
        return visible


@dataclass(kw_only=True)
class MlxStep(GatheredStep):
    """The step's metadata as MLX arrays, with the permutation that puts the gather groups'
    concatenated outputs back in token order."""

    positions: mx.array
    slot_mapping: mx.array
    rope_positions: mx.array
    logits_rows: mx.array
    token_order: mx.array

    @classmethod
    def prepare(cls, meta: StepMetadata, groups: list[GatherGroup]) -> MlxStep:
        order = np.concatenate([g.token_index for g in groups])
        return cls(
            meta=meta,
            groups=[_Group(mx.array(g.token_index.astype(np.int32)), mx.array(g.slots.astype(np.int32)),
                           mx.array(g.key_pos.astype(np.int32)), mx.array(g.query_pos.astype(np.int32)),
                           mx.array(g.valid)) for g in groups],
            positions=mx.array(meta.positions),
            slot_mapping=mx.array(meta.slot_mapping),
            rope_positions=mx.array(meta.rope_positions),
            logits_rows=mx.array(meta.logits_rows),
            token_order=mx.array(np.argsort(order).astype(np.int32)),
        )


def paged_attention(q, cache, step: MlxStep, scale, sliding_window, logit_softcap):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.key.shape[2]
    keys = cache.key.reshape(-1, num_kv_heads, head_dim)
    values = cache.value.reshape(-1, num_kv_heads, head_dim)
    # A cache in another dtype than q: the gathered keys and values and q all in float32, which
    # holds any of them exactly; the result in q's dtype.
    out_dtype = q.dtype
    compute_dtype = q.dtype if keys.dtype == q.dtype else mx.float32
    q = q.astype(compute_dtype)
    outputs = []
    for index, group in enumerate(step.groups):
        rows, queries = group.slots.shape[0], group.query_pos.shape[1]
        grouped_q = q[group.token_index].reshape(rows, queries, num_heads, head_dim).transpose(0, 2, 1, 3)
        k = keys[group.slots].astype(compute_dtype).transpose(0, 2, 1, 3)  # [R, Hk, S, D]
        v = values[group.slots].astype(compute_dtype).transpose(0, 2, 1, 3)
        visible = step.visible(index, sliding_window)[:, None]  # [R, 1, Qr, S]
        if logit_softcap is None:
            out = mx.fast.scaled_dot_product_attention(grouped_q, k, v, scale=scale, mask=visible)
        else:
            out = _softcapped(grouped_q, k, v, visible, scale, logit_softcap)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(rows * queries, num_heads, head_dim))
    return mx.concatenate(outputs, axis=0)[step.token_order].astype(out_dtype)


def _softcapped(q, k, v, visible, scale, cap):
    rows, num_heads, queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    grouped = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, queries, head_dim).astype(mx.float32)
    scores = grouped @ k[:, :, None].astype(mx.float32).swapaxes(-1, -2) * scale
    scores = mx.tanh(scores / cap) * cap
    scores = mx.where(visible[:, :, None], scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1)
    out = weights @ v[:, :, None].astype(mx.float32)
    return out.reshape(rows, num_heads, queries, head_dim).astype(q.dtype)


def paged_latent_attention(q_latent, q_rope, cache, step: MlxStep, scale):
    """Attention over a latent cache (see `Ops.paged_latent_attention`), in float32: a group's query
    heads and tokens stack into the rows of one matmul per part of the key, the latent serving as
    the value."""
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    latents = cache.value.reshape(-1, rank)
    rotary_keys = cache.key.reshape(-1, cache.key.shape[-1])
    outputs = []
    for index, group in enumerate(step.groups):
        rows, queries = group.slots.shape[0], group.query_pos.shape[1]
        latent_q = q_latent[group.token_index].reshape(rows, queries * num_heads, rank).astype(mx.float32)
        rotary_q = q_rope[group.token_index].reshape(rows, queries * num_heads, -1).astype(mx.float32)
        c = latents[group.slots].astype(mx.float32)  # [R, S, rank]
        r = rotary_keys[group.slots].astype(mx.float32)
        scores = (latent_q @ c.swapaxes(-1, -2) + rotary_q @ r.swapaxes(-1, -2)) * scale
        scores = mx.where(step.visible(index, None)[:, :, None], scores.reshape(rows, queries, num_heads, -1), -mx.inf)
        weights = mx.softmax(scores.reshape(rows, queries * num_heads, -1), axis=-1)
        outputs.append((weights @ c).reshape(rows * queries, num_heads, rank))
    return mx.concatenate(outputs, axis=0)[step.token_order].astype(q_latent.dtype)
