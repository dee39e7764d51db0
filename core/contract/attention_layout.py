"""Gather layouts for paged attention, worked out on the host once per step.

Backends that attend by gathering keys from the paged cache into dense blocks (numpy, MLX) need,
for each group of queries, the cache slot of every key and which keys each query may see. The
decodes of a step (one query token each) form one padded group; every sequence with several query
tokens (a prefill or a chunk of one) is a group of its own. Padding points at the sequence's own
first slot, which always holds real data, so a gather never touches a slot the step does not own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from candelabra.core.contract.step_metadata import StepMetadata


@dataclass(frozen=True)
class GatherGroup:
    """R rows of Qr queries each, attending over S gathered keys (int64 numpy arrays)."""

    token_index: np.ndarray  # [R * Qr] rows of the step's q, row by row
    slots: np.ndarray  # [R, S] cache slot of each key
    key_pos: np.ndarray  # [1, 1, S] key positions 0 .. S-1
    query_pos: np.ndarray  # [R, Qr, 1] position of each query
    valid: np.ndarray  # [R, 1, S] whether key j exists (j < seq_len)

    def visible(self, sliding_window: int | None) -> np.ndarray:
        """[R, Qr, S] bool: key j visible to the query at position p (j <= p, and j > p - W)."""
        visible = self.valid & (self.key_pos <= self.query_pos)
        if sliding_window is not None:
            visible &= self.key_pos > self.query_pos - sliding_window
        return visible


def gather_groups(meta: StepMetadata) -> list[GatherGroup]:
    starts = meta.query_start_loc.astype(np.int64)
    query_lens = np.diff(starts)
    seq_lens = meta.seq_lens.astype(np.int64)
    groups = []
    decodes = np.flatnonzero(query_lens == 1)
    if decodes.size:
        groups.append(_group(meta, decodes, int(seq_lens[decodes].max()), starts[decodes][:, None]))
    for b in np.flatnonzero(query_lens > 1):
        groups.append(_group(meta, np.array([b]), int(seq_lens[b]), np.arange(starts[b], starts[b + 1])[None, :]))
    return groups


def _group(meta: StepMetadata, seqs: np.ndarray, span: int, tokens: np.ndarray) -> GatherGroup:
    block_size = meta.block_size
    key_pos = np.arange(span)[None, :]
    valid = key_pos < meta.seq_lens[seqs].astype(np.int64)[:, None]
    blocks = np.take_along_axis(meta.block_tables[seqs].astype(np.int64), key_pos // block_size * valid, axis=1)
    slots = blocks * block_size + key_pos % block_size
    return GatherGroup(
        token_index=tokens.reshape(-1),
        slots=np.where(valid, slots, slots[:, :1]),
        key_pos=key_pos[:, None, :],
        query_pos=meta.positions[tokens].astype(np.int64)[:, :, None],
        valid=valid[:, None, :],
    )


@dataclass
class GatheredStep:
    """A prepared step for a gathering backend: the host metadata (whose fields it exposes), its
    gather groups in the backend's arrays (anything with `visible(sliding_window)`), and their
    visibility masks, computed once per sliding window and shared by all layers."""

    meta: StepMetadata
    groups: list[Any]
    _masks: dict = field(default_factory=dict, init=False, repr=False)

    def visible(self, index: int, sliding_window: int | None):
        key = (index, sliding_window)
        if key not in self._masks:
            self._masks[key] = self.groups[index].visible(sliding_window)
        return self._masks[key]

    def __getattr__(self, name: str):
        if name == "meta":
            raise AttributeError(name)
        return getattr(self.meta, name)
