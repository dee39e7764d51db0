"""The step's metadata as device tensors for the Triton kernels, shared by every layer.

Every tensor here is one a kernel reads on the device; nothing a kernel's launch grid depends on
varies with the sequences' lengths except `max_query_len`, so a decode step (max_query_len 1) of a
given padded size launches the same grids every time and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from candelabra.backends.torch.batched_upload import upload
from candelabra.core.contract.step_metadata import StepMetadata


@dataclass
class CudaStep:
    host: StepMetadata
    token_positions: torch.Tensor  # [T] int32: each query token's position in its sequence
    token_seq: torch.Tensor  # [T] int32: the sequence each token belongs to
    slot_mapping: torch.Tensor  # [T] int64, NO_SLOT (-1) writes nothing
    rope_positions: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_query_len: int
    # [D] int32: in a step that also has longer queries, the tokens of its one-token sequences (decodes),
    # which attention tiles apart from the rest; None where there are none, or only those
    decode_tokens: torch.Tensor | None = None

    @classmethod
    def prepare(cls, meta: StepMetadata, device: torch.device) -> CudaStep:
        query_lens = np.diff(meta.query_start_loc)
        names = ["token_positions", "token_seq", "slot_mapping", "rope_positions", "logits_rows", "query_start_loc",
                 "seq_lens", "block_tables"]
        arrays = [(meta.positions, torch.int32), (np.repeat(np.arange(meta.num_seqs), query_lens), torch.int32),
                  (meta.slot_mapping, torch.int64), (meta.rope_positions, torch.int64),
                  (meta.logits_rows, torch.int64), (meta.query_start_loc, torch.int32),
                  (meta.seq_lens, torch.int32), (meta.block_tables, torch.int32)]
        decodes = query_lens == 1
        if decodes.any() and not decodes.all():
            names.append("decode_tokens")
            arrays.append((meta.query_start_loc[:-1][decodes], torch.int32))
        return cls(host=meta, **dict(zip(names, upload(arrays, device))), block_size=meta.block_size,
                   max_query_len=int(meta.max_query_len))

    @property
    def num_tokens(self) -> int:
        return int(self.token_positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
