"""Embeddings from the served model: each input's hidden states after the final norm, pooled over
its tokens (the mean, or the last token's) and L2-normalized unless asked not to be.

How it runs without disturbing generation. The server hands `embed_with_engine` to the engine
thread (`AsyncEngine.run_between_steps`), so it runs between two steps, never concurrently with
one, and the event loop only awaits its result. It runs prefill-only forwards of the model alone,
as `ModelRunner.logits` does, without sampling. The forwards write the inputs' keys and values
(attention reads them back), so they need KV blocks: they are borrowed from the engine's own
BlockManager under negative sequence ids and placeholder tokens (-1) that no prompt can match,
never registered in the prefix cache, and all freed before the engine's next step, so no running
sequence's blocks are touched and the scheduler never sees them. Inputs are packed into forwards
of at most `max_batch_tokens` tokens; an input longer than `chunk_tokens` is prefilled in chunks
over its blocks, as the scheduler would, so a long input costs no more activation memory than a
long prompt does. When the cache cannot lend an input's blocks (running requests hold them),
`CacheBusy` says so and nothing is left allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.worker.model_runner import ModelRunner

POOLINGS = ("mean", "last")
PLACEHOLDER_TOKEN = -1  # booked in the block manager in place of real tokens: it hashes like no prompt


class CacheBusy(RuntimeError):
    """The KV cache cannot lend the blocks an input needs right now; retry later."""


class PoolingUnsupported(RuntimeError):
    """The served model cannot be pooled here (tensor parallelism)."""


@dataclass(frozen=True)
class _Piece:
    """Tokens [start, end) of input `index`, run in one forward."""

    index: int
    start: int
    end: int


def embed_with_engine(engine, inputs: Sequence[Sequence[int]], pooling: str = "mean",
                      normalize: bool = True) -> np.ndarray:
    """`embed` over an LLMEngine's model runner and block manager, batched as its config says. Call
    on the engine thread, between steps."""
    if engine.model.communicator is not None:
        raise PoolingUnsupported("embeddings are not available under tensor parallelism: the pooling forward "
                                 "would have to be broadcast to every rank")
    config = engine.config
    return embed(engine.runner, engine.core.blocks, inputs, pooling, normalize, config.max_num_batched_tokens,
                 config.prefill_chunk_size or config.max_num_batched_tokens)


def embed(runner: ModelRunner, blocks: BlockManager, inputs: Sequence[Sequence[int]], pooling: str = "mean",
          normalize: bool = True, max_batch_tokens: int = 2048, chunk_tokens: int = 512) -> np.ndarray:
    """Pooled final hidden states [len(inputs), hidden] in float32, one row per input (a list of
    token ids, none empty); `pooling` is "mean" or "last"; with `normalize` each row has L2 norm 1."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    if any(len(tokens) == 0 for tokens in inputs):
        raise ValueError("an input to embed is empty")
    if max_batch_tokens < 1 or chunk_tokens < 1:
        raise ValueError("max_batch_tokens and chunk_tokens must be at least 1")
    hidden_size = runner.model.config.hidden_size
    sums = np.zeros((len(inputs), hidden_size), np.float64)  # mean: the sum of the rows; last: the last row
    scratch = _ScratchBlocks(blocks)
    try:
        for forward in _forwards(inputs, max_batch_tokens, min(chunk_tokens, max_batch_tokens)):
            for piece in forward:
                if piece.start == 0:
                    scratch.borrow(piece.index, len(inputs[piece.index]))
            rows = _run(runner, inputs, forward, scratch, pooling)
            row = 0
            for piece in forward:
                length = piece.end - piece.start
                if pooling == "mean":
                    sums[piece.index] += rows[row:row + length].sum(axis=0, dtype=np.float64)
                    row += length
                else:
                    sums[piece.index] = rows[row]
                    row += 1
                if piece.end == len(inputs[piece.index]):
                    scratch.give_back(piece.index)
    finally:
        scratch.give_back_all()
    if pooling == "mean":
        sums /= np.array([len(tokens) for tokens in inputs], np.float64)[:, None]
    if normalize:
        sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return sums.astype(np.float32)


def _forwards(inputs: Sequence[Sequence[int]], max_batch_tokens: int, chunk_tokens: int) -> list[list[_Piece]]:
    """The inputs cut into chunks of at most `chunk_tokens` and packed, in order, into forwards of at
    most `max_batch_tokens` tokens, each holding at most one chunk of an input."""
    forwards: list[list[_Piece]] = [[]]
    used = 0
    for index, tokens in enumerate(inputs):
        for start in range(0, len(tokens), chunk_tokens):
            piece = _Piece(index, start, min(start + chunk_tokens, len(tokens)))
            size = piece.end - piece.start
            current = forwards[-1]
            if current and (used + size > max_batch_tokens or current[-1].index == index):
                forwards.append([])
                used = 0
            forwards[-1].append(piece)
            used += size
    return [forward for forward in forwards if forward]


def _run(runner: ModelRunner, inputs: Sequence[Sequence[int]], forward: list[_Piece], scratch: _ScratchBlocks,
         pooling: str) -> np.ndarray:
    """One forward of `forward`'s pieces: the final-normed hidden states on the host, in float32, of
    every token (mean pooling) or of each piece's last token (last pooling)."""
    model, backend = runner.model, runner.backend
    query_lens = [piece.end - piece.start for piece in forward]
    ends = np.cumsum(query_lens)
    rows = np.arange(int(ends[-1])) if pooling == "mean" else ends - 1
    meta = StepMetadata.build(query_lens, [piece.end for piece in forward],
                              [scratch.table(piece.index) for piece in forward], runner.kv_spec.block_size,
                              logits_rows=rows)
    step = backend.prepare_step(model.with_rope_positions(meta))
    token_ids = np.concatenate([np.asarray(inputs[p.index][p.start:p.end], np.int32) for p in forward])
    hidden, runner.caches = model.forward(backend.to_device(token_ids), step, runner.caches)
    normed = model.norm(model.final_norm, model.ops.gather_rows(hidden, step.logits_rows))
    backend.evaluate(normed, runner.caches)
    return np.asarray(backend.to_host(normed), np.float32)


class _ScratchBlocks:
    """KV blocks lent by a BlockManager for the inputs being pooled, booked under negative sequence
    ids and placeholder tokens, never registered in the prefix cache."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.held: set[int] = set()

    @staticmethod
    def _seq_id(index: int) -> int:
        return -1 - index

    def borrow(self, index: int, num_tokens: int) -> None:
        placeholder = [PLACEHOLDER_TOKEN] * num_tokens
        if not self.blocks.can_allocate(placeholder):
            raise CacheBusy(f"the KV cache has no room for an input of {num_tokens} tokens now "
                            f"({self.blocks.num_free_blocks} blocks of {self.blocks.block_size} free); retry later")
        self.blocks.allocate(self._seq_id(index), placeholder)
        self.held.add(index)

    def table(self, index: int) -> list[int]:
        return self.blocks.block_table(self._seq_id(index))

    def give_back(self, index: int) -> None:
        if index in self.held:
            self.held.discard(index)
            self.blocks.free(self._seq_id(index))

    def give_back_all(self) -> None:
        for index in list(self.held):
            self.give_back(index)
