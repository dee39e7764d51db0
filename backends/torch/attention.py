"""Paged attention in PyTorch: each group of queries gathers its sequences' whole cache blocks and runs one
dense attention.

A step's sequences fall into two groups: the decodes (one query each) and the prefills (several
queries each, padded to the longest). Gathering by block rather than by slot reads each block once
as one contiguous row. Keys past a sequence's end (the tail of its last block, the padding of its
block table) may hold anything, NaN included. They lie outside every query's window, so the mask
replaces their scores, and their values are zeroed so that a zero weight never meets a NaN. The query
heads that share a KV head are stacked into one matmul with it, so no KV head is copied per query head.
Every group runs two batched matmuls around a float32 softmax: with the fused
`scaled_dot_product_attention` for prefills (which rounds the softmax weights to bfloat16), greedy
tokens in bfloat16 diverged after a preemption by recompute, where a token decoded is read again in a
prefill. On the CPU the decodes go to the C kernel of decode_attention.py instead, also float32
throughout: it and the matmuls differ only in the order they add in, a rounding step of float32,
within the engine level's tie margins (in bfloat16 it parted on the same ties as before, on the four
seeds tried).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from candelabra.backends.torch.cpu.decode_attention import decode_attention, reads_natively
from candelabra.backends.torch.quantized_kv import dequantize_rows, is_quantized
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata

# Queries of a prefill attend this many at a time, so the float32 scores stay small
# (Hq x 256 x keys x 4 bytes: 14 MiB for 14 heads over 1,024 keys).
QUERY_CHUNK = 256


@dataclass
class QueryGroup:
    """R sequences with Q query slots each, over S = blocks * block_size keys. A sequence with
    fewer than Q queries repeats its last one in the padding slots, whose outputs are dropped."""

    token_index: torch.Tensor  # [R, Q] int64
    real_slots: torch.Tensor  # [N] int64: flat indices of the real query slots
    real_tokens: torch.Tensor  # [N] int64: the step tokens they answer for
    block_tables: torch.Tensor  # [R, blocks] int64
    seq_lens: torch.Tensor  # [R, 1, 1] int64
    query_pos: torch.Tensor  # [R, Q, 1] int64
    key_pos: torch.Tensor  # [1, 1, S] int64
    _masks: dict = field(default_factory=dict)

    @property
    def key_invalid(self) -> torch.Tensor:
        """[R, 1, S, 1] bool: no key at j (j >= seq_len)."""
        if "invalid" not in self._masks:
            self._masks["invalid"] = (self.key_pos >= self.seq_lens).reshape(self.seq_lens.shape[0], 1, -1, 1)
        return self._masks["invalid"]

    def visible(self, sliding_window: int | None) -> torch.Tensor:
        """[R, 1, 1, Q, S] bool: the key at j is visible to the query at p (j <= p, and j > p - W)."""
        if sliding_window not in self._masks:
            visible = self.key_pos <= self.query_pos
            if sliding_window is not None:
                visible = visible & (self.key_pos > self.query_pos - sliding_window)
            self._masks[sliding_window] = visible[:, None, None]
        return self._masks[sliding_window]


@dataclass
class TorchStep:
    """The step's metadata as torch tensors, shared by every layer."""

    host: StepMetadata
    slot_mapping: torch.Tensor
    rope_positions: torch.Tensor
    logits_rows: torch.Tensor
    groups: list[QueryGroup]

    @classmethod
    def prepare(cls, meta: StepMetadata, device: torch.device) -> TorchStep:
        query_lens = np.diff(meta.query_start_loc)
        groups = [_group(meta, seqs, device) for seqs in (np.flatnonzero(query_lens == 1),
                                                          np.flatnonzero(query_lens > 1)) if seqs.size]
        return cls(
            host=meta,
            slot_mapping=_tensor(meta.slot_mapping, device),
            rope_positions=_tensor(meta.rope_positions, device),
            logits_rows=_tensor(meta.logits_rows, device),
            groups=groups,
        )

    def __getattr__(self, name: str):
        if name == "host":
            raise AttributeError(name)
        return getattr(self.host, name)


def decodes_alone(step) -> QueryGroup | None:
    """The step's one group where it is this module's step and holds decodes alone (token r is then sequence r's
    one query), else None: a backend built on these ops may prepare steps of its own (cuda's CudaStep)."""
    if isinstance(step, TorchStep) and len(step.groups) == 1 and step.groups[0].token_index.shape[1] == 1:
        return step.groups[0]
    return None


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _group(meta: StepMetadata, seqs: np.ndarray, device: torch.device) -> QueryGroup:
    starts = meta.query_start_loc.astype(np.int64)
    query_lens = starts[seqs + 1] - starts[seqs]
    width = int(query_lens.max())
    offsets = np.arange(width)[None, :]
    real = offsets < query_lens[:, None]
    token_index = starts[seqs][:, None] + np.minimum(offsets, query_lens[:, None] - 1)
    seq_lens = meta.seq_lens[seqs].astype(np.int64)
    blocks = -(-int(seq_lens.max()) // meta.block_size)
    return QueryGroup(
        token_index=_tensor(token_index, device),
        real_slots=_tensor(np.flatnonzero(real), device),
        real_tokens=_tensor(token_index[real], device),
        block_tables=_tensor(meta.block_tables[seqs, :blocks], device),
        seq_lens=_tensor(seq_lens.reshape(-1, 1, 1), device),
        query_pos=_tensor(meta.positions[token_index].reshape(len(seqs), width, 1), device),
        key_pos=_tensor(np.arange(blocks * meta.block_size).reshape(1, 1, -1), device),
    )


def paged_attention(q: torch.Tensor, cache: KVCache, step: TorchStep, scale: float,
                    sliding_window: int | None, logit_softcap: float | None) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.key.shape[2]
    shared = num_heads // kv_heads
    out = torch.empty_like(q)
    for group in step.groups:
        rows, width = group.token_index.shape
        if width == 1 and reads_natively(cache):
            if decodes_alone(step) is group:
                return decode_attention(q, cache, group.block_tables, group.seq_lens, scale, sliding_window,
                                        logit_softcap).to(q.dtype)
            attended = decode_attention(q.index_select(0, group.real_tokens), cache, group.block_tables,
                                        group.seq_lens, scale, sliding_window, logit_softcap)
            out.index_copy_(0, group.real_tokens, attended.to(q.dtype))
            continue
        # [R, Hk, G, Q, D]: the G query heads that share a KV head side by side, so each KV head meets
        # all of its queries in one matmul and is never copied G times
        grouped_q = (q[group.token_index].reshape(rows, width, kv_heads, shared, head_dim)
                     .permute(0, 2, 3, 1, 4).float())
        k = _gathered(cache.key, group)
        v = _gathered(cache.value, group).masked_fill_(group.key_invalid, 0)
        visible = group.visible(sliding_window)
        attended = torch.cat([_explicit(grouped_q[:, :, :, start:start + QUERY_CHUNK], k, v,
                                        visible[:, :, :, start:start + QUERY_CHUNK], scale, logit_softcap)
                              for start in range(0, width, QUERY_CHUNK)], dim=3)
        attended = attended.permute(0, 3, 1, 2, 4).reshape(rows * width, num_heads, head_dim)
        out.index_copy_(0, group.real_tokens, attended.index_select(0, group.real_slots).to(q.dtype))
    return out


def paged_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: KVCache, step: TorchStep,
                           scale: float) -> torch.Tensor:
    """Attention over a latent cache (see `Ops.paged_latent_attention`): every query head meets the one
    KV head, so a group's query heads and query tokens stack into the rows of one matmul per part of the
    key (the latent and the rotary key), and the latent serves as the value."""
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    out = torch.empty_like(q_latent)
    for group in step.groups:
        rows, width = group.token_index.shape
        latents = _gathered(cache.value, group)[:, 0].masked_fill_(group.key_invalid[:, 0], 0)  # [R, S, rank]
        rotary_keys = _gathered(cache.key, group)[:, 0]  # [R, S, P]
        visible = group.visible(None)[:, 0, 0]  # [R, Q, S]
        parts = []
        for start in range(0, width, QUERY_CHUNK):
            tokens = group.token_index[:, start:start + QUERY_CHUNK]
            queries = tokens.shape[1]
            latent_q = q_latent[tokens].reshape(rows, queries * num_heads, rank).float()
            rotary_q = q_rope[tokens].reshape(rows, queries * num_heads, -1).float()
            scores = (latent_q @ latents.transpose(1, 2)).add_(rotary_q @ rotary_keys.transpose(1, 2)).mul_(scale)
            scores = scores.view(rows, queries, num_heads, -1).masked_fill_(
                ~visible[:, start:start + queries, None], -math.inf)
            weights = torch.softmax(scores.view(rows, queries * num_heads, -1), dim=-1)
            parts.append((weights @ latents).view(rows, queries, num_heads, rank))
        attended = torch.cat(parts, dim=1).reshape(rows * width, num_heads, rank)
        out.index_copy_(0, group.real_tokens, attended.index_select(0, group.real_slots).to(q_latent.dtype))
    return out


def _gathered(cache: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's keys (or values) in float32, [R, Hk, S, D]: a quantized cache's rows are dequantized
    here, as they are gathered, so only the blocks the step reads are. Past each sequence's end they hold
    whatever the cache did: every such key is outside every query's window."""
    rows, blocks = group.block_tables.shape
    gathered = cache[group.block_tables].reshape(rows, -1, *cache.shape[2:]).permute(0, 2, 1, 3)  # [R, Hk, S, D]
    if is_quantized(cache):
        return dequantize_rows(gathered)
    return gathered.to(torch.float32, memory_format=torch.contiguous_format)


def _explicit(q, k, v, visible, scale, cap):
    """Attention as two batched matmuls around a float32 softmax: q [R, Hk, G, Q, D] float32, k and v
    [R, Hk, S, D] float32, visible [R, 1, 1, Q, S]; gives [R, Hk, G, Q, D] float32."""
    rows, kv_heads, shared, queries, head_dim = q.shape
    scores = q.reshape(rows, kv_heads, shared * queries, head_dim) @ k.transpose(-1, -2)
    scores = scores.mul_(scale).view(rows, kv_heads, shared, queries, -1)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill_(~visible, -math.inf)
    out = torch.softmax(scores.view(rows, kv_heads, shared * queries, -1), dim=-1) @ v
    return out.view(rows, kv_heads, shared, queries, head_dim)
