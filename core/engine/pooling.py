"""Embeddings from the served model: each input's hidden states after the final norm, pooled over
its tokens (the mean, or the last token's) and L2-normalized unless asked not to be.

How it shares the engine with generation. An embeddings request is a `PoolingJob` that the engine
core advances a slice at a time, once per step, after the step's generation: the scheduler keeps
the slice's tokens out of the step's budget (after the running sequences', before new prompts'),
so a large request costs each step no more than a prompt chunk would, running decodes keep their
pace, and an abort between two slices stops it. A slice is one prefill-only forward of the model
alone, as `ModelRunner.logits` runs, without sampling, over at most `max_inputs` inputs (each one a
sequence of the forward, as the step's sequence limit bounds a step). An input longer than the
slice's room is prefilled in chunks over several slices, as the scheduler would a prompt, so a long
input costs no more activation memory than a long prompt does.

The forwards write the inputs' keys and values (attention reads them back), so they need KV blocks:
they are borrowed from the engine's own BlockManager under negative sequence ids and placeholder
tokens (-1) that no prompt can match, never registered in the prefix cache, each input's given back
when its last chunk has run. No running sequence's blocks are touched. An input whose blocks the
cache cannot lend now waits for a later slice (`advance` runs nothing); `embed`, which has nothing
to wait for, raises `CacheBusy` instead.
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


@dataclass
class PooledOutput:
    """A pooling request's result, handed out by the engine core's step that finished it."""

    request_id: str
    embeddings: np.ndarray  # [inputs, hidden] float32, one row per input
    num_tokens: int
    finished: bool = True


@dataclass(frozen=True)
class _Piece:
    """Tokens [start, end) of input `index`, run in one forward."""

    index: int
    start: int
    end: int


class PoolingJob:
    """One request's inputs (lists of token ids, none empty) on their way to pooled vectors: `advance`
    runs its next slice, `done` says when every input has run, `result` gives the vectors, `release`
    gives back the blocks it holds (after an abort)."""

    def __init__(self, inputs: Sequence[Sequence[int]], pooling: str = "mean", normalize: bool = True) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if not inputs:
            raise ValueError("there is nothing to embed")
        if any(len(tokens) == 0 for tokens in inputs):
            raise ValueError("an input to embed is empty")
        self.inputs, self.pooling, self.normalize = inputs, pooling, normalize
        self.num_tokens = sum(len(tokens) for tokens in inputs)
        self.remaining_tokens = self.num_tokens
        self._next = (0, 0)  # the input and the token where the next slice starts
        self._sums: np.ndarray | None = None  # mean: the sum of the rows; last: the last row
        self._scratch: _ScratchBlocks | None = None

    @property
    def done(self) -> bool:
        return self.remaining_tokens == 0

    @property
    def next_input(self) -> Sequence[int] | None:
        """The input the next slice starts in, or None when every input has run."""
        index = self._next[0]
        return self.inputs[index] if index < len(self.inputs) else None

    def advance(self, runner: ModelRunner, blocks: BlockManager, max_tokens: int, max_inputs: int,
                chunk_tokens: int) -> int:
        """Run one forward of at most `max_tokens` tokens of at most `max_inputs` inputs, each input's
        part at most `chunk_tokens` long; the tokens it ran (0 when the cache cannot lend the next
        input's blocks yet, or `max_tokens` is 0)."""
        if self._scratch is None:
            self._scratch = _ScratchBlocks(blocks)
            self._sums = np.zeros((len(self.inputs), runner.model.config.hidden_size), np.float64)
        forward = self._next_forward(max_tokens, max_inputs, chunk_tokens)
        if not forward:
            return 0
        rows = _run(runner, self.inputs, forward, self._scratch, self.pooling)
        row = 0
        for piece in forward:
            length = piece.end - piece.start
            if self.pooling == "mean":
                self._sums[piece.index] += rows[row:row + length].sum(axis=0, dtype=np.float64)
                row += length
            else:
                self._sums[piece.index] = rows[row]
                row += 1
            if piece.end == len(self.inputs[piece.index]):
                self._scratch.give_back(piece.index)
        ran = sum(piece.end - piece.start for piece in forward)
        self.remaining_tokens -= ran
        return ran

    def _next_forward(self, max_tokens: int, max_inputs: int, chunk_tokens: int) -> list[_Piece]:
        """The pieces of the next forward, from where the last one stopped, in order: each input's next
        chunk, whose blocks are borrowed as its first piece is taken; the forward ends at a chunk short of
        its input's end (the rest needs this chunk's keys and values first) or an input that cannot
        borrow its blocks now."""
        forward: list[_Piece] = []
        room = max_tokens
        index, start = self._next
        while index < len(self.inputs) and room > 0 and len(forward) < max_inputs:
            length = len(self.inputs[index])
            if start == 0 and not self._scratch.try_borrow(index, length):
                break
            end = min(length, start + chunk_tokens, start + room)
            forward.append(_Piece(index, start, end))
            room -= end - start
            index, start = (index + 1, 0) if end == length else (index, end)
            if start:
                break
        self._next = (index, start)
        return forward

    def result(self) -> np.ndarray:
        """The pooled vectors [len(inputs), hidden] in float32, once `done`."""
        if not self.done:
            raise RuntimeError(f"{self.remaining_tokens} of {self.num_tokens} tokens are still to run")
        sums = self._sums
        if self.pooling == "mean":
            sums = sums / np.array([len(tokens) for tokens in self.inputs], np.float64)[:, None]
        if self.normalize:
            sums = sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
        return sums.astype(np.float32)

    def release(self) -> None:
        """Give back every block the job holds; safe to call more than once."""
        if self._scratch is not None:
            self._scratch.give_back_all()


def check_poolable(engine) -> None:
    """PoolingUnsupported where the engine's model cannot be pooled."""
    if engine.model.communicator is not None:
        raise PoolingUnsupported("embeddings are not available under tensor parallelism: the pooling forward "
                                 "would have to be broadcast to every rank")


def embed(runner: ModelRunner, blocks: BlockManager, inputs: Sequence[Sequence[int]], pooling: str = "mean",
          normalize: bool = True, max_batch_tokens: int = 2048, chunk_tokens: int = 512,
          max_inputs: int | None = None) -> np.ndarray:
    """Pooled final hidden states [len(inputs), hidden] in float32, one row per input (a list of
    token ids, none empty), run at once in forwards of at most `max_batch_tokens` tokens (and
    `max_inputs` inputs); `pooling` is "mean" or "last"; with `normalize` each row has L2 norm 1.
    CacheBusy, with nothing left allocated, where the cache cannot lend an input's blocks."""
    if max_batch_tokens < 1 or chunk_tokens < 1:
        raise ValueError("max_batch_tokens and chunk_tokens must be at least 1")
    job = PoolingJob(inputs, pooling, normalize)
    try:
        while not job.done:
            if not job.advance(runner, blocks, max_batch_tokens, max_inputs or len(inputs), chunk_tokens):
                raise CacheBusy(f"the KV cache has no room for an input of {len(job.next_input)} tokens now "
                                f"({blocks.num_free_blocks} blocks of {blocks.block_size} free); retry later")
    finally:
        job.release()
    return job.result()


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

    _ids = iter(range(1, 2**62))  # one range for every job, so that two jobs' inputs never share an id

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.held: dict[int, int] = {}  # input index: the negative sequence id its blocks are booked under

    def try_borrow(self, index: int, num_tokens: int) -> bool:
        """Book blocks for input `index`'s tokens; False, booking nothing, where the cache cannot lend them."""
        placeholder = [PLACEHOLDER_TOKEN] * num_tokens
        if not self.blocks.can_allocate(placeholder):
            return False
        seq_id = -next(self._ids)
        self.blocks.allocate(seq_id, placeholder)
        self.held[index] = seq_id
        return True

    def table(self, index: int) -> list[int]:
        return self.blocks.block_table(self.held[index])

    def give_back(self, index: int) -> None:
        seq_id = self.held.pop(index, None)
        if seq_id is not None:
            self.blocks.free(seq_id)

    def give_back_all(self) -> None:
        for index in list(self.held):
            self.give_back(index)
