"""Runs a model on its backend for one step: a batch in, logits out, the paged caches kept here."""

from __future__ import annotations

import numpy as np

from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.models.base import DecoderModel


class ModelRunner:
    """Owns the per-layer KV caches of one model and turns batches into logits."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int,
                 kv_cache_dtype: DType | None = None) -> None:
        """`kv_cache_dtype`: the caches' dtype (default: the model's compute dtype)."""
        c = model.config
        self.model, self.backend = model, model.backend
        self.kv_spec = KVCacheSpec(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                   kv_cache_dtype or model.dtype)
        self.caches = self.backend.allocate_kv_cache(self.kv_spec)

    def execute(self, token_ids: np.ndarray, meta: StepMetadata, all_logits: bool = False):
        """Logits [B, vocab] for the last token of each sequence in the batch (or [T, vocab] for
        every token), as a backend tensor. `token_ids` [T] are the step's new tokens, laid out as
        `meta` says; their keys and values are written to the cache on the way."""
        if meta.block_size != self.kv_spec.block_size:
            raise ValueError(f"step uses blocks of {meta.block_size}, the cache has {self.kv_spec.block_size}")
        backend = self.backend
        step = backend.prepare_step(meta)
        ids = backend.to_device(np.asarray(token_ids, dtype=np.int32))
        rope_positions = self.model.rope_positions(meta)
        if rope_positions is not None:
            rope_positions = backend.to_device(rope_positions)
        hidden, self.caches = self.model.forward(ids, step, rope_positions, self.caches)
        rows = np.arange(meta.num_tokens) if all_logits else meta.query_start_loc[1:] - 1
        logits = self.model.compute_logits(hidden, backend.to_device(rows.astype(np.int32)))
        backend.evaluate(logits, self.caches)
        return logits
