"""Paged attention in numpy over the step's gather layouts (see candelabra.core.contract.attention_layout).

The decodes of a step share one batched matmul; each multi-token sequence is one dense block.
"""

from __future__ import annotations

import numpy as np

from candelabra.core.contract.attention_layout import GatheredStep, gather_groups
from candelabra.core.contract.kv_quantization import dequantize_kv_rows, storage_kv_dtype
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata


def prepare_step(meta: StepMetadata) -> GatheredStep:
    return GatheredStep(meta, gather_groups(meta))


def paged_attention(
    q: np.ndarray,
    cache: KVCache,
    step: GatheredStep,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> np.ndarray:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.key.shape[2]
    keys = cache.key.reshape(-1, *cache.key.shape[2:])
    values = cache.value.reshape(-1, *cache.value.shape[2:])
    out = np.empty_like(q)
    for index, group in enumerate(step.groups):
        rows, queries = group.slots.shape[0], group.query_pos.shape[1]
        # [R, Hk, G, Qr, D] against keys [R, Hk, 1, D, S]
        grouped_q = q[group.token_index].reshape(rows, queries, num_kv_heads, -1, head_dim).transpose(0, 2, 3, 1, 4)
        k = _read(keys, group.slots).transpose(0, 2, 3, 1)[:, :, None]
        v = _read(values, group.slots).transpose(0, 2, 1, 3)[:, :, None]
        scores = np.matmul(grouped_q, k) * np.float32(scale)
        if logit_softcap is not None:
            scores = np.tanh(scores / np.float32(logit_softcap)) * np.float32(logit_softcap)
        scores = np.where(step.visible(index, sliding_window)[:, None, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = np.matmul(scores, v)  # [R, Hk, G, Qr, D]
        out[group.token_index] = attended.transpose(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    return out


def paged_latent_attention(q_latent: np.ndarray, q_rope: np.ndarray, cache: KVCache, step: GatheredStep,
                           scale: float) -> np.ndarray:
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    latents = cache.value.reshape(-1, cache.value.shape[-1])
    rotary_keys = cache.key.reshape(-1, cache.key.shape[-1])
    out = np.empty_like(q_latent)
    for index, group in enumerate(step.groups):
        rows, queries = group.slots.shape[0], group.query_pos.shape[1]
        # every query head of every query token against the group's one KV head: [R, Qr * H, S]
        latent_q = q_latent[group.token_index].reshape(rows, queries * num_heads, rank).astype(np.float32)
        rotary_q = q_rope[group.token_index].reshape(rows, queries * num_heads, -1).astype(np.float32)
        c = _read(latents, group.slots).astype(np.float32)  # [R, S, rank]
        r = _read(rotary_keys, group.slots).astype(np.float32)  # [R, S, P]
        scores = (np.matmul(latent_q, c.transpose(0, 2, 1)) + np.matmul(rotary_q, r.transpose(0, 2, 1)))
        scores = scores.reshape(rows, queries, num_heads, -1) * np.float32(scale)
        scores = np.where(step.visible(index, None)[:, :, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = np.matmul(scores.reshape(rows, queries * num_heads, -1), c)
        out[group.token_index] = attended.reshape(rows * queries, num_heads, rank)
    return out


def _read(cache: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The cache's rows at `slots`, dequantized to float32 where the cache is quantized: only the rows
    the step reads are decoded."""
    rows = cache[slots]
    kv_dtype = storage_kv_dtype(str(cache.dtype))
    return rows if kv_dtype is None else dequantize_kv_rows(rows, kv_dtype)
