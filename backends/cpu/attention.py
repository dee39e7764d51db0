"""Paged attention in numpy over gather indices computed once per step.

Sequences with a single query token (decodes) are gathered into one padded batch and handled by
one batched matmul; each sequence with several query tokens (a prefill or a chunk of one) is one
dense block. Padding points at the sequence's own first slot, which always holds real data, so
nothing the step does not own is ever read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from candelabra.core.ops import KVCache
from candelabra.core.step_metadata import StepMetadata


@dataclass
class _KeyLayout:
    """Where a group of queries finds its keys, and which of them each query may see."""

    token_index: np.ndarray  # [Q] rows of q belonging to the group
    slots: np.ndarray  # [R, S] cache slots of the keys (R = 1 for a prefill, Bd for decodes)
    key_pos: np.ndarray  # [R, 1, S] key positions
    query_pos: np.ndarray  # [R, Qr, 1] positions of each row's queries
    valid: np.ndarray  # [R, 1, S] key exists (j < seq_len)
    _masks: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> np.ndarray:
        """[R, Qr, S]: key j visible to the query at position p."""
        if sliding_window not in self._masks:
            visible = self.valid & (self.key_pos <= self.query_pos)
            if sliding_window is not None:
                visible &= self.key_pos > self.query_pos - sliding_window
            self._masks[sliding_window] = visible
        return self._masks[sliding_window]


@dataclass
class CpuStep:
    """A StepMetadata with the attention gather layouts worked out."""

    meta: StepMetadata
    decodes: _KeyLayout | None
    prefills: list[_KeyLayout]

    def __getattr__(self, name: str):
        if name == "meta":
            raise AttributeError(name)
        return getattr(self.meta, name)


def prepare_step(meta: StepMetadata) -> CpuStep:
    block_size = meta.block_size
    starts = meta.query_start_loc.astype(np.int64)
    query_lens = np.diff(starts)
    seq_lens = meta.seq_lens.astype(np.int64)
    decode_seqs = np.flatnonzero(query_lens == 1)
    prefill_seqs = np.flatnonzero(query_lens > 1)
    decodes = None
    if decode_seqs.size:
        span = int(seq_lens[decode_seqs].max())
        decodes = _layout(meta, decode_seqs, span, block_size, starts[decode_seqs][:, None])
    prefills = [
        _layout(meta, np.array([b]), int(seq_lens[b]), block_size, np.arange(starts[b], starts[b + 1])[None, :])
        for b in prefill_seqs
    ]
    return CpuStep(meta, decodes, prefills)


def _layout(meta: StepMetadata, seqs: np.ndarray, span: int, block_size: int, tokens: np.ndarray) -> _KeyLayout:
    key_pos = np.arange(span)[None, :]
    seq_lens = meta.seq_lens[seqs].astype(np.int64)[:, None]
    valid = key_pos < seq_lens
    blocks = np.take_along_axis(meta.block_tables[seqs].astype(np.int64), key_pos // block_size * valid, axis=1)
    slots = blocks * block_size + key_pos % block_size
    slots = np.where(valid, slots, slots[:, :1])
    return _KeyLayout(
        token_index=tokens.reshape(-1),
        slots=slots,
        key_pos=key_pos[:, None, :],
        query_pos=meta.positions[tokens].astype(np.int64)[:, :, None],
        valid=valid[:, None, :],
    )


def paged_attention(
    q: np.ndarray,
    cache: KVCache,
    step: CpuStep,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> np.ndarray:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.key.shape[2]
    keys = cache.key.reshape(-1, num_kv_heads, head_dim)
    values = cache.value.reshape(-1, num_kv_heads, head_dim)
    out = np.empty_like(q)
    groups = ([step.decodes] if step.decodes is not None else []) + step.prefills
    for layout in groups:
        rows, queries = layout.slots.shape[0], layout.query_pos.shape[1]
        # [R, Hk, G, Qr, D] against keys [R, Hk, 1, D, S]
        grouped_q = q[layout.token_index].reshape(rows, queries, num_kv_heads, -1, head_dim).transpose(0, 2, 3, 1, 4)
        k = keys[layout.slots].transpose(0, 2, 3, 1)[:, :, None]
        v = values[layout.slots].transpose(0, 2, 1, 3)[:, :, None]
        scores = np.matmul(grouped_q, k) * np.float32(scale)
        if logit_softcap is not None:
            scores = np.tanh(scores / np.float32(logit_softcap)) * np.float32(logit_softcap)
        scores = np.where(layout.mask(sliding_window)[:, None, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = np.matmul(scores, v)  # [R, Hk, G, Qr, D]
        out[layout.token_index] = attended.transpose(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    return out
