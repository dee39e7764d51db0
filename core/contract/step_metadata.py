"""What one model step needs to know about its batch, built once per step on the host.

Everything here is a plain numpy array. A backend turns a `StepMetadata` into its own tensors in
one call (`Backend.prepare_step`) before the step's ops run, and a `SamplingMetadata` likewise
(`Backend.prepare_sampling`); ops never see Python lists and never move data back to the host
inside a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

# Marks a token whose K/V must not be written (padding of a fixed-size batch).
NO_SLOT = -1
# Pads the per-sequence token lists of SamplingMetadata.
NO_TOKEN = -1


@dataclass(frozen=True)
class StepMetadata:
    """The batch layout of one step: B sequences contributing T tokens in total.

    The T tokens are the sequences' new tokens, concatenated sequence after sequence. Sequence b
    owns tokens `query_start_loc[b]:query_start_loc[b+1]`; they are its last
    `query_len = query_start_loc[b+1] - query_start_loc[b]` tokens, so its first new token sits
    at position `seq_lens[b] - query_len`. A decode contributes one token, a (chunk of a) prefill
    several.

    positions[T] int32       position of each token in its sequence (for rotary embedding)
    slot_mapping[T] int32    cache slot (block * block_size + offset) receiving each token's
                             K/V, or NO_SLOT to write nothing
    query_start_loc[B+1] int32   offsets of each sequence's tokens; [0] == 0, [B] == T
    seq_lens[B] int32        tokens of each sequence in the cache once this step's are written
    block_tables[B, max_blocks] int32   the cache blocks of each sequence, in order; entries
                             past a sequence's `ceil(seq_len / block_size)` blocks are padding:
                             any valid block id, never read
    block_size               slots per cache block
    max_query_len, max_seq_len   maxima of the query lengths and of seq_lens
    logits_rows[N] int32     the tokens whose hidden states become the step's logits rows, in the
                             order of the sampling rows (a token may appear more than once: the n
                             samples of one prompt share its last token's row)
    rope_positions[T] int32  the row of the model's rotary table for each token: its position,
                             or, for rope scalings that switch tables with a sequence's length, an
                             offset into the stacked tables

    The core itself reads only `slot_mapping` (for `write_kv`), `rope_positions` (for `rotary`)
    and `logits_rows` (for `gather_rows` before the LM head) from the prepared step; the rest is
    for the backend's `paged_attention`. A batch may be padded with sequences of one token whose
    slot is NO_SLOT; their outputs are unspecified and never read.
    """

    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int
    max_query_len: int
    max_seq_len: int
    logits_rows: np.ndarray
    rope_positions: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        max_blocks: int | None = None,
        logits_rows: Sequence[int] | np.ndarray | None = None,
        slot_mapping: np.ndarray | None = None,
    ) -> StepMetadata:
        """Lay out a batch from each sequence's new-token count, total length and block list.
        `logits_rows` defaults to each sequence's last token; `rope_positions` to the positions
        (see `with_rope_positions`); `slot_mapping` to the slots the block tables give (pass one
        with NO_SLOT entries for padding)."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens_arr = np.asarray(seq_lens, dtype=np.int64)
        if query_lens.shape != seq_lens_arr.shape or query_lens.ndim != 1:
            raise ValueError("query_lens and seq_lens must be 1-D and of equal length")
        if len(block_tables) != len(query_lens):
            raise ValueError("one block table is needed per sequence")
        if np.any(query_lens < 1) or np.any(query_lens > seq_lens_arr):
            raise ValueError("each sequence needs 1 <= query_len <= seq_len")
        needed = -(-seq_lens_arr // block_size)
        held = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        short = np.flatnonzero(held < needed)
        if short.size:
            b = int(short[0])
            raise ValueError(f"sequence {b} holds {seq_lens_arr[b]} tokens and needs {needed[b]} blocks "
                             f"of {block_size}, but its block table has {held[b]}")
        width = max(max_blocks or 0, int(held.max(initial=0)), 1)
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = table

        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        offset_in_query = np.arange(starts[-1]) - starts[seq_of_token]
        positions = seq_lens_arr[seq_of_token] - query_lens[seq_of_token] + offset_in_query
        if slot_mapping is None:
            blocks = tables[seq_of_token, positions // block_size].astype(np.int64)
            slot_mapping = blocks * block_size + positions % block_size
        rows = starts[1:] - 1 if logits_rows is None else np.asarray(logits_rows)
        if rows.size and (rows.min() < 0 or rows.max() >= starts[-1]):
            raise ValueError(f"logits_rows must index the step's {starts[-1]} tokens")
        return cls(
            positions=positions.astype(np.int32),
            slot_mapping=np.asarray(slot_mapping).astype(np.int32),
            query_start_loc=starts.astype(np.int32),
            seq_lens=seq_lens_arr.astype(np.int32),
            block_tables=tables,
            block_size=block_size,
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens_arr.max(initial=0)),
            logits_rows=rows.astype(np.int32),
            rope_positions=positions.astype(np.int32),
        )

    def with_rope_positions(self, rope_positions: np.ndarray) -> StepMetadata:
        return replace(self, rope_positions=np.asarray(rope_positions, dtype=np.int32))


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters for a batch of B logit rows.

    temperature[B] float32     0 means greedy
    top_k[B] int32             keep the k most probable tokens; 0 disables
    top_p[B] float32           nucleus mass; 1 disables
    min_p[B] float32           drop tokens below min_p * (highest probability); 0 disables
    repetition_penalty[B] float32    1 disables
    presence_penalty[B], frequency_penalty[B] float32    0 disables
    penalty_tokens[B, Lr] int32      tokens the repetition penalty applies to (the prompt and the
                                     output, or the last `repeat_last_n` of them), NO_TOKEN padded
    output_tokens[B, Lo] int32       tokens generated so far (presence and frequency penalties),
                                     NO_TOKEN padded
    bias_token_ids[B, Lb] int32, bias_values[B, Lb] float32   additive logit bias, NO_TOKEN padded
    uniform[B] float32         one draw from [0, 1) per row, made in float32 so that it stays
                               below 1; the host's per-request generator makes sampling seeded
                               and the same on every backend
    num_top_logprobs int       how many top logprobs to return per row (0: none)
    allowed_token_mask[B, ceil(V / 32)] int32 or None   the tokens each row may choose, as bits:
                               bit j (value 1 << j) of word w allows token 32 * w + j. Structured
                               output fills it from its grammar; a row with every bit set is
                               unconstrained, and None leaves every row so. Each row allows at
                               least one token.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    penalty_tokens: np.ndarray
    output_tokens: np.ndarray
    bias_token_ids: np.ndarray
    bias_values: np.ndarray
    uniform: np.ndarray
    num_top_logprobs: int = 0
    allowed_token_mask: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    def __post_init__(self) -> None:
        rows = self.temperature.shape[0]
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, np.ndarray) and value.shape[0] != rows:
                raise ValueError(f"SamplingMetadata.{field.name} has {value.shape[0]} rows, expected {rows}")
        if self.bias_token_ids.shape != self.bias_values.shape:
            raise ValueError("bias_token_ids and bias_values must have the same shape")
        if self.uniform.dtype != np.float32:
            raise ValueError("uniform draws must be float32 (a float64 draw may round up to 1)")
        if np.any((self.uniform < 0) | (self.uniform >= 1)):
            raise ValueError("uniform draws must lie in [0, 1)")
        if np.any((self.top_p <= 0) | (self.top_p > 1)):
            raise ValueError("top_p must lie in (0, 1]")
        if np.any(self.temperature < 0):
            raise ValueError("temperature must be >= 0")
        if self.num_top_logprobs < 0:
            raise ValueError("num_top_logprobs must be >= 0")
        mask = self.allowed_token_mask
        if mask is not None:
            if mask.dtype != np.int32 or mask.ndim != 2:
                raise ValueError("allowed_token_mask must be a 2-D int32 bitmask")
            if not np.all(mask.any(axis=1)):
                raise ValueError("allowed_token_mask leaves a row no token to choose")


def token_mask_words(vocab_size: int) -> int:
    """The int32 words of an allowed-token mask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def pad_token_lists(lists: Sequence[Sequence[int]], min_width: int = 1) -> np.ndarray:
    """Stack ragged token lists into an int32 [len(lists), width] array padded with NO_TOKEN."""
    width = max(min_width, max(map(len, lists), default=0))
    out = np.full((len(lists), width), NO_TOKEN, dtype=np.int32)
    for row, tokens in enumerate(lists):
        if len(tokens):  # most rows of a step have none: no penalty, no bias
            out[row, : len(tokens)] = tokens
    return out


def plain_sampling(temperature: float, top_p: float, uniform: np.ndarray) -> SamplingMetadata:
    """Sampling for len(uniform) rows at one temperature and top-p, with no other filter, penalty, bias
    or logprobs: what benchmarks and compile checks sample with."""
    rows = len(uniform)
    empty = pad_token_lists([[] for _ in range(rows)])
    return SamplingMetadata(
        temperature=np.full(rows, temperature, np.float32), top_k=np.zeros(rows, np.int32),
        top_p=np.full(rows, top_p, np.float32), min_p=np.zeros(rows, np.float32),
        repetition_penalty=np.ones(rows, np.float32), presence_penalty=np.zeros(rows, np.float32),
        frequency_penalty=np.zeros(rows, np.float32), penalty_tokens=empty, output_tokens=empty,
        bias_token_ids=empty, bias_values=np.zeros(empty.shape, np.float32),
        uniform=np.asarray(uniform, np.float32), num_top_logprobs=0, allowed_token_mask=None)
