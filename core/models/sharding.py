"""Tensor parallelism's sharding rules: which part of each weight rank r of W keeps.

Weights are [out_features, in_features]. A column-parallel projection keeps some of its output
features (rows): each rank computes its part of the output, and nothing is exchanged. A row-parallel
projection keeps the input features (columns) matching the column-parallel output before it: each
rank computes a partial sum of the whole output, summed over ranks by one all-reduce, and its bias
is added on rank 0 only, so that the sum holds it once.

- Attention: q, k and v column-parallel by heads (`shard_heads`), kept fused per rank as
  [q_local; k_local; v_local] (`HeadShard.qkv_rows`); the output projection row-parallel over the
  same query heads (`HeadShard.output_columns`).
- MLP: gate and up (or fc1) column-parallel over a range of the intermediate features, kept fused per
  rank as [gate_local; up_local]; down (or fc2) row-parallel over the same range
  (`intermediate_columns`).
- MoE layer: the router replicated (every rank routes every token), the experts split whole
  (expert parallelism): each rank keeps a contiguous share of the experts (`expert_share`), runs
  only its own experts' picks, and its partial output joins the MLP's all-reduce. Why whole experts
  rather than a share of every expert's intermediate features: docs/design-notes.md, "Experts under
  tensor parallelism".
- LM head: replicated, or vocabulary-parallel (`vocab_rows`): each rank computes the logits of its
  tokens, and an all-gather joins them.
- Everything else (embedding, norms, q/k norms, rotary tables) is replicated.

Slicing rows is exact for dense and quantized weights alike; slicing columns of a quantized weight
is exact only on its block boundaries (`take_columns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, RowStack

HostWeight = np.ndarray | QuantizedTensor | RowStack

# How the LM head is split over the ranks: each rank holding the whole head, or the rows of its share
# of the vocabulary.
REPLICATED, VOCAB_PARALLEL = "replicated", "vocab_parallel"
LM_HEAD_LAYOUTS = (REPLICATED, VOCAB_PARALLEL)
# Vocabulary-parallel was never slower, and each rank holds half the head (docs/design-notes.md, "The LM
# head under tensor parallelism", has the measurements).
DEFAULT_LM_HEAD_LAYOUT = VOCAB_PARALLEL


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank keeps: the query heads it computes and the KV heads they read,
    as ranges of the model's head indices."""

    query_heads: range
    kv_heads: range

    def qkv_rows(self, num_heads: int, num_kv_heads: int, head_dim: int) -> list[range]:
        """The rows of the fused [q; k; v] projection (num_heads, num_kv_heads and num_kv_heads heads
        of head_dim rows) this rank keeps, in order: its q, k and v heads."""
        k_offset, v_offset = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        return [_times(self.query_heads, head_dim), _times(self.kv_heads, head_dim, k_offset),
                _times(self.kv_heads, head_dim, v_offset)]

    def output_columns(self, head_dim: int) -> range:
        """The input features of the attention output projection this rank keeps: its query heads'."""
        return _times(self.query_heads, head_dim)


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """The heads rank `rank` of `world_size` keeps: query heads [r*H/W, (r+1)*H/W), and KV heads
    [r*K/W, (r+1)*K/W) when there are at least as many KV heads K as ranks, else the one KV head its
    query heads read (grouped-query attention: query head h reads KV head h // (H/K)), which
    W/K ranks then each keep a copy of.

    ValueError when W does not divide H, when K >= W and W does not divide K, or when K < W and K
    does not divide W (a rank's query heads would then read two KV heads)."""
    if num_heads % world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits the model's {num_heads} query heads "
                         f"evenly, but {world_size} does not divide {num_heads}: use a world size that does")
    per_rank = num_heads // world_size
    query_heads = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor parallelism over {world_size} ranks splits the model's {num_kv_heads} KV heads "
                             f"evenly, but {world_size} does not divide {num_kv_heads}: use a world size that does")
        kv_per_rank = num_kv_heads // world_size
        return HeadShard(query_heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    if world_size % num_kv_heads:
        raise ValueError(f"with {num_kv_heads} KV heads, {world_size} ranks would give some rank query heads that read "
                         f"two KV heads: use a world size that is a multiple of {num_kv_heads}")
    kv_head = query_heads.start // (num_heads // num_kv_heads)
    return HeadShard(query_heads, range(kv_head, kv_head + 1))


def intermediate_columns(size: int, rank: int, world_size: int, block: int = 1) -> range:
    """The MLP's intermediate features rank `rank` of `world_size` keeps, out of `size`: contiguous,
    shares differing by at most one `block`, every boundary a multiple of `block` (the row-parallel
    weight's quantization block, so that its column shard stays quantized). Where `size` is not made
    of at least `world_size` whole blocks, shares of single features. ValueError when `size` <
    `world_size`."""
    if size < world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits the MLP's {size} intermediate features, "
                         f"fewer than the ranks: use at most {size} ranks")
    if size % block or size // block < world_size:
        block = 1
    return _share(size // block, rank, world_size, block)


def expert_share(num_experts: int, rank: int, world_size: int) -> range:
    """The experts of a MoE layer rank `rank` of `world_size` keeps, out of `num_experts`: contiguous,
    num_experts // world_size or one more each. ValueError when there are fewer experts than ranks,
    which would leave a rank none."""
    if num_experts < world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits each MoE layer's {num_experts} experts, "
                         f"fewer than the ranks: use at most {num_experts} ranks")
    return _share(num_experts, rank, world_size, 1)


def vocab_rows(vocab_size: int, rank: int, world_size: int) -> tuple[range, int]:
    """The vocabulary-parallel LM head's rows (token ids) rank `rank` of `world_size` keeps, and
    the rows every rank's shard is padded to with zero rows, ceil(vocab_size / world_size), so
    that the ranks' logits are alike in shape and joined in rank order give the vocabulary in order
    (followed by padding to cut off)."""
    padded = -(-vocab_size // world_size)
    start = min(rank * padded, vocab_size)
    return range(start, min(start + padded, vocab_size)), padded


def quantization_block(format: str | None) -> int:
    """How many consecutive values of a row one block of quantized `format` holds; 1 for None (dense)."""
    if format in INT4_GROUP_FORMATS:
        return INT4_GROUP_FORMATS[format]
    return 1 if format is None else GGML_QUANT_SIZES[GGMLQuantizationType[format]][0]


def take_rows(weight: HostWeight, ranges: Sequence[range]) -> HostWeight:
    """The rows of `weight` (2-D, or a 1-D bias) in `ranges`, one range after another; exact for
    quantized weights, whose rows are independent (and share their column order). A row stack's rows
    stay in their parts' formats."""
    if isinstance(weight, RowStack):
        return RowStack.of([take_rows(part, [piece]) for r in ranges for part, piece in _pieces(weight, r)])
    if isinstance(weight, QuantizedTensor):
        blocks = _rows(weight.blocks, ranges)
        return QuantizedTensor(weight.format, blocks, (blocks.shape[0], weight.shape[1]), weight.column_order)
    return _rows(weight, ranges)


def take_experts(stacked: HostWeight, experts: range) -> HostWeight:
    """The experts `experts` of a MoE layer's stacked projection [E, out, in], dense or quantized."""
    if isinstance(stacked, QuantizedTensor):
        blocks = stacked.blocks[experts.start : experts.stop]
        return QuantizedTensor(stacked.format, blocks, (len(experts), *stacked.shape[1:]), stacked.column_order)
    return stacked[experts.start : experts.stop]


def take_columns(weight: HostWeight, columns: range) -> HostWeight:
    """The columns (input features) of 2-D `weight` in `columns`. A quantized weight stays quantized
    where both ends of `columns` lie on its block boundaries; otherwise the blocks covering them are
    dequantized and the result is a float32 array of exactly those columns' values. So is a weight
    whose columns are stored permuted (act-order GPTQ): the columns of a range are spread over all
    its blocks. A row stack's parts are each taken so, and stay a row stack where all stay quantized."""
    start, stop = columns.start, columns.stop
    if isinstance(weight, RowStack):
        parts = [take_columns(part, columns) for part in weight.parts]
        if all(isinstance(part, QuantizedTensor) for part in parts):
            return RowStack.of(parts)
        return np.concatenate([part if isinstance(part, np.ndarray) else part.dequantize() for part in parts])
    if isinstance(weight, QuantizedTensor) and weight.column_order is not None:
        weight = weight.dequantize()
    if not isinstance(weight, QuantizedTensor):
        return np.ascontiguousarray(weight[:, start:stop])
    values, size = weight.values_per_block, weight.bytes_per_block
    first, last = start // values, -(-stop // values)
    covering = QuantizedTensor(weight.format, np.ascontiguousarray(weight.blocks[:, first * size : last * size]),
                               (weight.shape[0], (last - first) * values))
    if start % values == 0 and stop % values == 0:
        return covering
    offset = first * values
    return np.ascontiguousarray(covering.dequantize()[:, start - offset : stop - offset])


def pad_rows(weight: HostWeight, rows: int) -> HostWeight:
    """`weight` (2-D, or a 1-D bias) with zero rows appended up to `rows` rows. A quantized weight
    gains rows of zero bytes, which every quantized format decodes to zeros (their scales are zero)."""
    missing = rows - weight.shape[0]
    if missing <= 0:
        return weight
    if isinstance(weight, RowStack):
        *first, last = weight.parts
        return RowStack.of([*first, pad_rows(last, last.shape[0] + missing)])
    if isinstance(weight, QuantizedTensor):
        zeros = np.zeros((missing, weight.blocks.shape[1]), dtype=np.uint8)
        return QuantizedTensor(weight.format, np.concatenate([weight.blocks, zeros]), (rows, weight.shape[1]),
                               weight.column_order)
    return np.concatenate([weight, np.zeros((missing, *weight.shape[1:]), dtype=weight.dtype)])


def check_lm_head_layout(layout: str) -> str:
    """`layout` if it is one of LM_HEAD_LAYOUTS, else a ValueError naming them."""
    if layout not in LM_HEAD_LAYOUTS:
        raise ValueError(f"unknown LM head layout {layout!r}; expected one of {', '.join(LM_HEAD_LAYOUTS)}")
    return layout


def _share(units: int, rank: int, world_size: int, unit: int) -> range:
    """Rank's contiguous share of `units` units of `unit` indices each, shares differing by at most one unit."""
    return range(rank * units // world_size * unit, (rank + 1) * units // world_size * unit)


def _times(heads: range, head_dim: int, offset: int = 0) -> range:
    """The rows of `heads`, `head_dim` rows each, starting at row `offset`."""
    return range(offset + heads.start * head_dim, offset + heads.stop * head_dim)


def _pieces(stack: RowStack, rows: range) -> list[tuple[QuantizedTensor, range]]:
    """The parts of `stack` that `rows` (of the whole) cross, each with the range of its own rows taken."""
    pieces, offset = [], 0
    for part in stack.parts:
        start, stop = max(rows.start, offset), min(rows.stop, offset + part.shape[0])
        if start < stop:
            pieces.append((part, range(start - offset, stop - offset)))
        offset += part.shape[0]
    return pieces


def _rows(array: np.ndarray, ranges: Sequence[range]) -> np.ndarray:
    parts = [array[r.start : r.stop] for r in ranges]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
