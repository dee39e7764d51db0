"""One GPTQ or AWQ linear weight, from its checkpoint tensors to a grouped int4 `QuantizedTensor`.

GPTQ: `qweight` int32 [K / 8, N] packs eight input features a word (feature 8r + j in bits 4j of
row r); `qzeros` int32 [K / g, N / 8] packs eight output features a word the same way; `scales`
[K / g, N]; `g_idx` [K] the group of each input feature (not i // g under act-order). A v1 checkpoint
stores each zero point minus one. AWQ (GEMM): `qweight` [K, N / 8] and `qzeros` [K / g, N / 8] both
pack output features, word nibble p holding feature AWQ_ORDER[p] of its eight. Both: w = (q - z) * s.

The result is exact: a group of g is cut into groups of the largest grouped int4 size dividing it
(each repeating the scale and zero), and act-order becomes `column_order` (the input features sorted
by group) when every group is then g contiguous features. A weight that fits neither (groups of no
such size, act-order groups of other sizes, a v1 zero point of 16) is dequantized to float32 instead,
with a log line saying why.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, int4_group_format, pack_int4_groups
from candelabra.core.weights.int4_config import Int4Scheme

log = logging.getLogger("candelabra")

# AWQ's GEMM layout: nibble p of a word holds output feature AWQ_ORDER[p] of its eight, so feature c
# is in nibble AWQ_UNPACK[c].
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
AWQ_UNPACK = np.argsort(AWQ_ORDER)
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


@dataclasses.dataclass(frozen=True)
class Int4Groups:
    """A quantized linear's groups unpacked: zero points and scales [groups, N] (float32), and
    `group_of` [K], the group of each input feature."""

    zeros: np.ndarray
    scales: np.ndarray
    group_of: np.ndarray


@dataclasses.dataclass(frozen=True)
class Int4Plan:
    """How a weight is stored: in grouped int4 `format` (groups of `size`), its input features in
    `column_order` (None: as they are), or, where `problem` says why not, dequantized."""

    format: str | None
    size: int = 0
    column_order: np.ndarray | None = None
    problem: str | None = None


def unpack_groups(scheme: Int4Scheme, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                  rows: int, name: str) -> Int4Groups:
    """The groups of a weight of `rows` input features; ValueError naming it when the shapes disagree."""
    zeros = unpack_columns(qzeros, AWQ_UNPACK if scheme.method == "awq" else None).astype(np.int16)
    zeros += 1 if scheme.zeros_minus_one else 0
    scales = np.asarray(scales, dtype=np.float32)
    if zeros.shape != scales.shape:
        raise ValueError(f"{name}: qzeros {list(qzeros.shape)} and scales {list(scales.shape)} do not describe the "
                         f"zero points and scales of one {scheme.method.upper()} weight's groups")
    group = rows if scheme.group_size == -1 else scheme.group_size
    if g_idx is None:
        if len(scales) != -(-rows // group):
            raise ValueError(f"{name}: {rows} input features in groups of {group} make {-(-rows // group)} groups, "
                             f"but scales has {len(scales)}")
        return Int4Groups(zeros, scales, np.arange(rows) // group)
    group_of = np.asarray(g_idx).astype(np.int64)
    if group_of.shape != (rows,) or group_of.min(initial=0) < 0 or group_of.max(initial=0) >= len(scales):
        raise ValueError(f"{name}: g_idx {list(group_of.shape)} must give each of the {rows} input features one of "
                         f"the {len(scales)} groups")
    return Int4Groups(zeros, scales, group_of)


def unpack_codes(scheme: Int4Scheme, qweight: np.ndarray) -> np.ndarray:
    """The 4-bit codes of `qweight`, input features first: uint8 [K, N]."""
    return unpack_columns(qweight, AWQ_UNPACK) if scheme.method == "awq" else unpack_rows(qweight)


def plan_int4(scheme: Int4Scheme, groups: Int4Groups) -> Int4Plan:
    """Whether, and how, the weight with these groups is exactly a grouped int4 weight."""
    rows = len(groups.group_of)
    group = rows if scheme.group_size == -1 else scheme.group_size
    problem, order = _stored_order(groups.group_of, group)
    size = _int4_group_size(group, rows)
    if problem is None and size is None:
        problem = (f"its groups of {group} input features are not made of groups of "
                   f"{', '.join(map(str, INT4_GROUP_FORMATS.values()))}")
    if problem is None and np.any(groups.zeros > 15):
        problem = "a zero point is 16 (a GPTQ v1 checkpoint's stored 15), outside int4's 0 to 15"
    if problem is not None:
        return Int4Plan(None, problem=problem)
    return Int4Plan(int4_group_format(size), size, order)


def to_weight(codes: np.ndarray, groups: Int4Groups, plan: Int4Plan, name: str) -> QuantizedTensor | np.ndarray:
    """The weight [N, K] from its codes [K, N] and groups, stored as `plan` says (float32 where it
    has a problem, logged)."""
    if plan.format is None:
        log.info("%s: dequantized to float32 at load, since %s", name, plan.problem)
        return dequantize_int4(codes, groups)
    order, size = plan.column_order, plan.size
    stored = codes if order is None else codes[order]
    group_of = groups.group_of if order is None else groups.group_of[order]
    first_of_each = group_of[::size]  # the checkpoint group of each int4 group
    weight = pack_int4_groups(stored.T, groups.scales[first_of_each].T, groups.zeros[first_of_each].T)
    return dataclasses.replace(weight, column_order=order)


def dequantize_int4(codes: np.ndarray, groups: Int4Groups) -> np.ndarray:
    """float32 [N, K] from codes [K, N]: w = (q - z) * s, each input feature in its group."""
    group_of = groups.group_of
    values = (codes.astype(np.float32) - groups.zeros[group_of]) * groups.scales[group_of]
    return np.ascontiguousarray(values.T)


def _stored_order(group_of: np.ndarray, group: int) -> tuple[str | None, np.ndarray | None]:
    """(why the input features cannot be stored in groups of `group`, None), or (None, the order to
    store them in: None where they are in order already)."""
    rows = len(group_of)
    in_order = np.arange(rows) // group
    if np.array_equal(group_of, in_order):
        return None, None
    order = np.argsort(group_of, kind="stable")
    if np.array_equal(group_of[order], in_order):
        return None, order.astype(np.int32)
    return "its g_idx does not give every group exactly group_size input features", None


def _int4_group_size(group: int, rows: int) -> int | None:
    """The largest grouped int4 size that divides both the checkpoint's groups and the row."""
    fitting = [size for size in INT4_GROUP_FORMATS.values() if group % size == 0 and rows % size == 0]
    return max(fitting, default=None)


def unpack_rows(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C], eight 4-bit values a word along the rows, as uint8 [8R, C]."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    nibbles = (words[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(-1, words.shape[1]).astype(np.uint8)


def unpack_columns(packed: np.ndarray, nibble_of: np.ndarray | None = None) -> np.ndarray:
    """int32 [R, C], eight 4-bit values a word along the columns, as uint8 [R, 8C]: column 8c + j from
    nibble `nibble_of[j]` of word c (nibble j where None)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    nibbles = (words[:, :, None] >> _SHIFTS) & 0xF
    if nibble_of is not None:
        nibbles = nibbles[:, :, nibble_of]
    return nibbles.reshape(words.shape[0], -1).astype(np.uint8)
