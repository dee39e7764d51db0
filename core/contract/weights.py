"""Weights as the core hands them to `Backend.upload_weight`: a role, and a dense array or a
`QuantizedTensor` still in its GGUF block format.

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
    """A 2-D weight on the host, still in a GGUF quantized format, or a stack of them alike (one
    MoE layer's experts, role experts).

    `format` is the GGML type name ("Q4_K"); `shape` the logical (out_features, in_features), or
    (experts, out_features, in_features) for a stack; `blocks` the bytes exactly as the GGUF file
    stores them, one row of blocks per output row: uint8 [out_features, in_features /
    values_per_block * bytes_per_block], with the experts first for a stack. Rows are independent,
    so taking or concatenating rows of `blocks` does the same to the weight's rows.
    """

    format: str
    blocks: np.ndarray
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        ggml_type = _quantized_type(self.format)
        if len(self.shape) not in (2, 3):
            raise ValueError(f"a quantized weight is 2-D (out_features, in_features), or 3-D with the experts of a "
                             f"MoE layer first, got shape {self.shape}")
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))
        *rows, columns = self.shape
        values, size = GGML_QUANT_SIZES[ggml_type]
        if columns % values:
            raise ValueError(f"{self.format} packs {values} values per block; {columns} columns are not whole blocks")
        expected = (*rows, columns // values * size)
        if self.blocks.dtype != np.uint8 or self.blocks.shape != expected:
            described = " x ".join(map(str, self.shape))
            raise ValueError(f"{self.format} blocks of a {described} weight are uint8 {list(expected)}, "
                             f"got {self.blocks.dtype} {list(self.blocks.shape)}")

    @property
    def values_per_block(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.format]][0]

    @property
    def bytes_per_block(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.format]][1]

    def dequantize(self) -> np.ndarray:
        """The weight's values, float32 in `shape`, as gguf decodes them."""
        values = dequantize(self.blocks, GGMLQuantizationType[self.format])
        return values.astype(np.float32, copy=False).reshape(self.shape)

    @classmethod
    def concatenate(cls, parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The parts' rows one after another (a fused projection); they must be 2-D and share format
        and in_features."""
        _check_alike(parts, "stack rows of", lambda part: (part.format, len(part.shape), part.shape[-1]))
        rows = sum(part.shape[0] for part in parts)
        return cls(parts[0].format, np.concatenate([part.blocks for part in parts]), (rows, parts[0].shape[1]))

    @classmethod
    def stack(cls, experts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """2-D weights of one format and shape, one per expert, as one 3-D stack."""
        _check_alike(experts, "stack experts from", lambda part: (part.format, part.shape))
        return cls(experts[0].format, np.stack([part.blocks for part in experts]), (len(experts), *experts[0].shape))

    def unstack(self) -> list[QuantizedTensor]:
        """A stack's experts, each a 2-D weight (views of these blocks)."""
        if len(self.shape) != 3:
            raise ValueError(f"a {self.format} weight of shape {self.shape} is not a stack of experts")
        return [QuantizedTensor(self.format, blocks, self.shape[1:]) for blocks in self.blocks]


def _check_alike(parts: Sequence[QuantizedTensor], action: str, kind) -> None:
    kinds = {kind(part) for part in parts}
    if not parts or len(kinds) != 1 or len(parts[0].shape) != 2:
        raise ValueError(f"cannot {action} quantized weights that differ in format or width, or are not 2-D: "
                         f"{sorted(kinds)}")


def _quantized_type(name: str) -> GGMLQuantizationType:
    ggml_type = GGMLQuantizationType.__members__.get(name)
    if ggml_type is None or GGML_QUANT_SIZES[ggml_type][0] == 1:
        known = ", ".join(GGUF_QUANTIZED_FORMATS)
        raise ValueError(f"{name!r} is not a quantized GGUF format; candelabra reads {known}")
    return ggml_type
