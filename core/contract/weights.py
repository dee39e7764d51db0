"""Weights as the core hands them to `Backend.upload_weight`: a role, and a dense array or a
`QuantizedTensor` still in its block format: a GGUF one, or one of the grouped int4 formats GPTQ and
AWQ checkpoints are converted to at load.

A backend lists the formats it keeps in `Backend.quantized_formats`. Only weights of its
`Backend.quantized_roles` (linear and LM head unless it adds the embedding or the experts) stored in
one of those formats reach it quantized; the core dequantizes everything else to float32 first, so a
backend that keeps no formats only ever sees dense arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

# The quantized GGUF formats candelabra reads, by GGML type name.
GGUF_QUANTIZED_FORMATS: tuple[str, ...] = (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# Grouped affine int4, what GPTQ and AWQ checkpoints become at load, by format name: the number of
# values per group along in_features. A block is one group: float16 scale s, float16 zero z (a whole
# number 0 to 15), then group / 2 bytes holding value 2i in the low nibble of byte i and value 2i + 1
# in its high nibble; w = (q - z) * s.
INT4_GROUP_FORMATS: dict[str, int] = {"INT4_G32": 32, "INT4_G64": 64, "INT4_G128": 128, "INT4_G256": 256}
INT4_GROUP_HEADER_BYTES = 4

QUANTIZED_FORMATS: tuple[str, ...] = (*GGUF_QUANTIZED_FORMATS, *INT4_GROUP_FORMATS)


def int4_group_format(group_size: int) -> str:
    """The grouped int4 format of `group_size` values a group."""
    for name, size in INT4_GROUP_FORMATS.items():
        if size == group_size:
            return name
    raise ValueError(f"grouped int4 weights have groups of {', '.join(map(str, INT4_GROUP_FORMATS.values()))} "
                     f"values, not {group_size}")


class WeightRole(str, Enum):
    """What a weight is used for, and so which op receives it."""

    EMBEDDING = "embedding"  # the table of `Ops.embedding`, [vocab, hidden]
    LM_HEAD = "lm_head"  # the weight of the last `Ops.linear`, [vocab, hidden]; may be the embedding again
    LINEAR = "linear"  # the weight of every other `Ops.linear`, [out_features, in_features]
    NORM = "norm"  # the weight of a norm op, [hidden]
    BIAS = "bias"  # the bias of a linear or a layer norm, [features]
    EXPERTS = "experts"  # one MoE layer's stacked expert weights for `Ops.moe_experts`, [experts, out, in]
    PER_HEAD = "per_head"  # one matrix per attention head for `Ops.per_head_linear`, [heads, out, in]


# Roles whose weights reach a backend still quantized unless it says otherwise: those `Ops.linear`
# multiplies by.
QUANTIZABLE_ROLES = frozenset({WeightRole.LINEAR, WeightRole.LM_HEAD})


def stays_quantized(role: WeightRole, stored_format: str | None, kept_formats: frozenset[str],
                    kept_roles: frozenset[WeightRole] = QUANTIZABLE_ROLES) -> bool:
    """Whether a weight of `role` stored in `stored_format` (None: stored dense) reaches a backend
    that keeps `kept_formats` for `kept_roles` still quantized."""
    return stored_format is not None and role in kept_roles and stored_format in kept_formats


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A 2-D weight on the host, still in a quantized format, or a stack of them alike (one MoE
    layer's experts, role experts).

    `format` is a GGML type name ("Q4_K") or a grouped int4 format ("INT4_G128"); `shape` the
    logical (out_features, in_features), or (experts, out_features, in_features) for a stack;
    `blocks` the bytes, exactly as a GGUF file stores them for the GGML types, one row of blocks per
    output row: uint8 [out_features, in_features / values_per_block * bytes_per_block], with the
    experts first for a stack. Rows are independent, so taking or concatenating rows of `blocks` does
    the same to the weight's rows.

    `column_order` (int32 [in_features], or None for the identity) says the stored columns are the
    weight's columns permuted: stored column j is column `column_order[j]` of the weight, so
    x @ W.T = x[..., column_order] @ stored.T. A GPTQ checkpoint quantized with act-order (desc_act)
    loads so, its columns sorted by group; `dequantize` undoes the permutation.
    """

    format: str
    blocks: np.ndarray
    shape: tuple[int, ...]
    column_order: np.ndarray | None = None

    def __post_init__(self) -> None:
        values, size = _block_sizes(self.format)
        if len(self.shape) not in (2, 3):
            raise ValueError(f"a quantized weight is 2-D (out_features, in_features), or 3-D with the experts of a "
                             f"MoE layer first, got shape {self.shape}")
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))
        *rows, columns = self.shape
        if self.column_order is not None:
            order = np.asarray(self.column_order)
            if order.shape != (columns,) or not np.array_equal(np.sort(order), np.arange(columns)):
                raise ValueError(f"column_order of a weight with {columns} columns must be a permutation of "
                                 f"0..{columns - 1}, got shape {list(order.shape)}")
            object.__setattr__(self, "column_order", order.astype(np.int32))
        if columns % values:
            raise ValueError(f"{self.format} packs {values} values per block; {columns} columns are not whole blocks")
        expected = (*rows, columns // values * size)
        if self.blocks.dtype != np.uint8 or self.blocks.shape != expected:
            described = " x ".join(map(str, self.shape))
            raise ValueError(f"{self.format} blocks of a {described} weight are uint8 {list(expected)}, "
                             f"got {self.blocks.dtype} {list(self.blocks.shape)}")

    @property
    def values_per_block(self) -> int:
        return _block_sizes(self.format)[0]

    @property
    def bytes_per_block(self) -> int:
        return _block_sizes(self.format)[1]

    def dequantize(self) -> np.ndarray:
        """The weight's values, float32 in `shape` and in the weight's own column order (GGML types as
        gguf decodes them)."""
        if self.format in INT4_GROUP_FORMATS:
            stored = _dequantize_int4_groups(self.blocks, self.values_per_block).reshape(self.shape)
        else:
            values = dequantize(self.blocks, GGMLQuantizationType[self.format])
            stored = values.astype(np.float32, copy=False).reshape(self.shape)
        if self.column_order is None:
            return stored
        weight = np.empty_like(stored)
        weight[..., self.column_order] = stored
        return weight

    @classmethod
    def concatenate(cls, parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The parts' rows one after another (a fused projection); they must be 2-D and share format
        and in_features."""
        _check_alike(parts, "stack rows of", lambda part: (part.format, len(part.shape), part.shape[-1]))
        _check_same_order(parts)
        rows = sum(part.shape[0] for part in parts)
        return cls(parts[0].format, np.concatenate([part.blocks for part in parts]), (rows, parts[0].shape[1]),
                   parts[0].column_order)

    @classmethod
    def stack(cls, experts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """2-D weights of one format and shape, one per expert, as one 3-D stack."""
        _check_alike(experts, "stack experts from", lambda part: (part.format, part.shape))
        _check_same_order(experts)
        return cls(experts[0].format, np.stack([part.blocks for part in experts]), (len(experts), *experts[0].shape),
                   experts[0].column_order)

    def unstack(self) -> list[QuantizedTensor]:
        """A stack's experts, each a 2-D weight (views of these blocks)."""
        if len(self.shape) != 3:
            raise ValueError(f"a {self.format} weight of shape {self.shape} is not a stack of experts")
        return [QuantizedTensor(self.format, blocks, self.shape[1:], self.column_order) for blocks in self.blocks]


@dataclass(frozen=True, eq=False)
class RowStack:
    """A fused projection whose parts are quantized in different formats, each part kept in its own: the
    parts' rows one after another. llama.cpp's Q4_K_M files store such projections (attn_v in Q6_K or
    Q8_0 beside attn_q and attn_k in Q4_K or Q5_0), which joined dense would take four to eight times
    the memory. It reaches a backend only where `Backend.keeps_row_stacks` and every part's format is
    among its `quantized_formats`; anywhere else the core joins the parts dequantized.

    `parts` are 2-D, of one width and one column order, neighbours in different formats (`of` joins
    neighbours alike); x @ W.T is the parts' products side by side."""

    parts: tuple[QuantizedTensor, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if len(parts) < 2 or any(len(part.shape) != 2 for part in parts) or len({part.shape[1] for part in parts}) != 1:
            raise ValueError("a row stack is two or more 2-D quantized weights of one width, got shapes "
                             f"{[part.shape for part in parts]}")
        if any(a.format == b.format for a, b in zip(parts, parts[1:])):
            raise ValueError("a row stack's neighbouring parts differ in format, got "
                             f"{[part.format for part in parts]}: join them with RowStack.of")
        _check_same_order(parts)
        object.__setattr__(self, "parts", parts)

    @classmethod
    def of(cls, parts: Sequence[QuantizedTensor]) -> QuantizedTensor | RowStack:
        """The parts' rows one after another, neighbours of one format joined: one `QuantizedTensor` where
        they all share it, else a row stack."""
        if not parts:
            raise ValueError("a row stack is made of one or more quantized weights, got none")
        runs: list[list[QuantizedTensor]] = []
        for part in parts:
            if runs and runs[-1][0].format == part.format:
                runs[-1].append(part)
            else:
                runs.append([part])
        joined = [run[0] if len(run) == 1 else QuantizedTensor.concatenate(run) for run in runs]
        return joined[0] if len(joined) == 1 else cls(tuple(joined))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(part.format for part in self.parts)

    def dequantize(self) -> np.ndarray:
        """The weight's values, float32 [rows, in_features], as the parts' dequantized rows joined."""
        return np.concatenate([part.dequantize() for part in self.parts])


def _check_alike(parts: Sequence[QuantizedTensor], action: str, kind) -> None:
    kinds = {kind(part) for part in parts}
    if not parts or len(kinds) != 1 or len(parts[0].shape) != 2:
        raise ValueError(f"cannot {action} quantized weights that differ in format or width, or are not 2-D: "
                         f"{sorted(kinds)}")


def same_column_order(parts: Sequence[QuantizedTensor]) -> bool:
    """Whether the parts' columns are stored in one order: none permuted, or all alike (as act-order GPTQ
    layers reading the same input are)."""
    orders = [part.column_order for part in parts]
    if all(order is None for order in orders):
        return True
    return all(order is not None for order in orders) and all(np.array_equal(orders[0], order) for order in orders)


def _check_same_order(parts: Sequence[QuantizedTensor]) -> None:
    if not same_column_order(parts):
        raise ValueError("cannot join quantized weights whose columns are stored in different orders "
                         "(act-order GPTQ layers with different g_idx)")


def _block_sizes(name: str) -> tuple[int, int]:
    """(values, bytes) of one block of quantized format `name`."""
    if name in INT4_GROUP_FORMATS:
        group = INT4_GROUP_FORMATS[name]
        return group, INT4_GROUP_HEADER_BYTES + group // 2
    ggml_type = GGMLQuantizationType.__members__.get(name)
    if ggml_type is None or GGML_QUANT_SIZES[ggml_type][0] == 1:
        raise ValueError(f"{name!r} is not a quantized format; candelabra reads {', '.join(QUANTIZED_FORMATS)}")
    return GGML_QUANT_SIZES[ggml_type]


def int4_group_fields(blocks: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grouped int4 blocks uint8 [..., groups * (4 + group / 2)] split into their packed codes uint8
    [..., groups, group / 2], scales and zeros float32 [..., groups]."""
    grouped = blocks.reshape(*blocks.shape[:-1], -1, INT4_GROUP_HEADER_BYTES + group // 2)
    header = np.ascontiguousarray(grouped[..., :INT4_GROUP_HEADER_BYTES]).view(np.float16).astype(np.float32)
    return grouped[..., INT4_GROUP_HEADER_BYTES:], header[..., 0], header[..., 1]


def unpack_int4_codes(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] to codes uint8 [..., 2n]: value 2i from the low nibble of byte i, 2i + 1 from its high one."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _dequantize_int4_groups(blocks: np.ndarray, group: int) -> np.ndarray:
    """Grouped int4 blocks uint8 [..., groups * (4 + group / 2)] to float32 [..., groups * group]."""
    packed, scale, zero = int4_group_fields(blocks, group)
    values = (unpack_int4_codes(packed).astype(np.float32) - zero[..., None]) * scale[..., None]
    return values.reshape(*blocks.shape[:-1], -1)


def pack_int4_groups(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> QuantizedTensor:
    """A [N, K] weight in the grouped int4 format whose groups hold K / scales.shape[1] values: `codes`
    integers 0..15 [N, K], `scales` [N, K / group] (rounded to float16) and `zeros` whole numbers
    0..15 [N, K / group]; w = (codes - zeros) * scales."""
    rows, columns = codes.shape
    groups = scales.shape[1]
    if columns % groups or zeros.shape != scales.shape or scales.shape[0] != rows:
        raise ValueError(f"codes {list(codes.shape)} with scales {list(scales.shape)} and zeros "
                         f"{list(zeros.shape)}: K must be a whole number of groups, scales and zeros one per group")
    group = columns // groups
    name = int4_group_format(group)
    if np.any((codes < 0) | (codes > 15)) or np.any((zeros < 0) | (zeros > 15)) or np.any(zeros != np.rint(zeros)):
        raise ValueError("int4 codes and zero points are whole numbers 0 to 15")
    header = np.stack([scales.astype(np.float16), zeros.astype(np.float16)], axis=-1).view(np.uint8)
    pairs = codes.astype(np.uint8).reshape(rows, groups, group // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    blocks = np.concatenate([header.reshape(rows, groups, INT4_GROUP_HEADER_BYTES), packed], axis=-1)
    return QuantizedTensor(name, blocks.reshape(rows, -1), (rows, columns))
