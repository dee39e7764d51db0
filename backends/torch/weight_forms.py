"""The forms a weight is kept in on a torch CPU, and the kernels that multiply each form.

A form holds a [N, K] weight for x @ W.T: `Int4Weight` (int4 groups of 32 to 256 along K with a
scale and a zero each, its columns possibly stored permuted), `Int8Weight` (int8 values with one
scale per output row), `PackedInt8Weight` (packed_int8.py) and `DenseWeight`. Each names its kernels
(`kernels()`: name to a function of a contiguous [M, K] x), gives its values back densely
(`dense()`), and multiplies through the kernel its `choice` names for the number of rows
(kernel_selection.py sets it from the kernel table). A form made without a choice runs
`DEFAULT_CHOICES`, what an Intel CPU with AMX measured fastest.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from candelabra.backends.torch.kernel_table import Choice, band_index

# Values per int4 group of the GGUF 4-bit formats; the grouped int4 formats' groups are 32 to 256.
INT4_GROUP_SIZE = 32
# torch packs int4 weights in tiles of 16 output rows; other row counts are padded up to it.
INT4_ROW_TILE = 16
# The int8 kernel reads K in steps of 16: other widths crash it or give wrong sums (torch 2.13).
INT8_COLUMN_STEP = 16
# An int4 weight rebuilt densely for a GEMM is rebuilt INT4_SLICE_ELEMENTS at a time: the rebuild makes
# float32 temporaries that must stay in the cache (9728 x 896 at 128 rows, 2 cores with AMX: slices of
# 1 Mi elements 11.0 ms, whole 35).
INT4_SLICE_ELEMENTS = 2**20
# The int32 products of a wide weight are made and scaled a slice of output columns at a time, so that
# each slice is still in the cache when it is scaled (an LM head's products for 64 rows are 78 MB).
PRODUCT_SLICE_ELEMENTS = 2**19
# Elements of the shared buffer dense slices are rebuilt in (32 MiB of bfloat16): reused rather than
# allocated, since fresh pages cost more than the rebuild itself. A weight that fits is rebuilt whole;
# a larger one (an LM head) in slices of SLICE_ELEMENTS, which the GEMM then reads from the cache: the
# LM head at 64 rows took 136 ms in slices of 16 Mi elements, 79 in slices of 4 Mi.
SCRATCH_ELEMENTS = 16 * 2**20
SLICE_ELEMENTS = 4 * 2**20

DEFAULT_CHOICES = {
    "int4": Choice("int4", ("int4_mm", "int4_mm", "int4_mm", "int4_mm", "rebuild")),
    "int8": Choice("int8", ("int8_mm", "int8_mm", "int8_split", "int8_split", "rebuild")),
    "int8_packed": Choice("int8_packed", ("onednn",) * 5),
    "dense": Choice("dense", ("dense",) * 5),
}


class KeptWeight(ABC):
    """What every form shares: the kernel chosen for a number of rows, and leading dims kept."""

    form: str
    shape: tuple[int, int]
    dtype: torch.dtype
    # Kernels that round x to 8 bits per block first, as llama.cpp multiplies: their error is that
    # rounding's, which the kernel table names only with $CANDELABRA_INT8_ACTIVATIONS=1.
    rounds_activations: frozenset[str] = frozenset()

    def default_choice(self) -> Choice:
        """The kernels a form runs without a choice from the kernel table: what an Intel CPU with AMX measured
        fastest."""
        return DEFAULT_CHOICES[self.form]

    @property
    def choice(self) -> Choice:
        return self.__dict__.get("_choice") or self.default_choice()

    @choice.setter
    def choice(self, choice: Choice) -> None:
        kernels = self.kernels()
        self._choice = choice
        self._by_band = tuple(kernels[name] for name in choice.kernels)

    @abstractmethod
    def kernels(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Each kernel of the form by name: x [rows, K] to x @ W.T."""

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weight in the compute dtype. A form that cannot give its values back
        (oneDNN's packed int8) leaves this out, and its Candidate supplies them."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its values back")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T [..., N], by the kernel chosen for x's rows."""
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        by_band = self.__dict__.get("_by_band")
        if by_band is None:
            self.choice = self.choice
            by_band = self._by_band
        out = by_band[band_index(flat.shape[0])](flat)
        return out.reshape(*x.shape[:-1], self.shape[0])


class Int4Weight(KeptWeight):
    """A [N, K] weight as int4 groups of `group_size` values along K (32 to 256) with a scale and a
    zero each, w = (q - 8) * scale + zero, for x @ W.T on a CPU.

    The groups hold the weight's columns in the order they are stored: with a `column_order` (an
    act-order GPTQ weight), stored column j is weight column column_order[j], and every kernel
    multiplies x with its columns taken in that order (one index_select). `dense` and `rows` give the
    weight in its own column order. Besides torch's packed layout it keeps the nibbles two to a byte in
    row order, from which rows are read back (an embedding) and a dense copy is rebuilt for a batch.
    """

    form = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, shape: tuple[int, int],
                 nibble_pairs: torch.Tensor, column_order: torch.Tensor | None = None) -> None:
        self.packed = packed  # uint8 [N', K / 2] in torch's own int4 CPU layout, N' = N padded to whole tiles
        self.scales_and_zeros = scales_and_zeros  # compute dtype [K / group_size, N', 2]
        self.shape = shape
        self.nibble_pairs = nibble_pairs  # uint8 [N, K / 2]: stored column 2j in the low nibble, 2j + 1 in the high
        self.group_size = shape[1] // scales_and_zeros.shape[0]
        self.column_order = column_order  # int64 [K]: the weight column of each stored column; None: the same
        self.stored_column = None if column_order is None else torch.argsort(column_order)  # the inverse

    @classmethod
    def from_groups(cls, nibbles: np.ndarray, scales: np.ndarray, zeros: np.ndarray, dtype: torch.dtype,
                    column_order: np.ndarray | None = None) -> Int4Weight:
        """From `int4_groupwise`'s arrays (groups of K / scales.shape[1] values, columns in `column_order`),
        with scales and zeros rounded to `dtype`, the compute dtype."""
        rows = nibbles.shape[0]
        padding = -rows % INT4_ROW_TILE
        # padded rows are (8 - 8) * 0 + 0: zero, and cut off the output
        nibbles = np.pad(nibbles, ((0, padding), (0, 0)), constant_values=8)
        scales, zeros = np.pad(scales, ((0, padding), (0, 0))), np.pad(zeros, ((0, padding), (0, 0)))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(nibbles.astype(np.int32)), 1)
        scales_and_zeros = torch.from_numpy(np.stack([scales.T, zeros.T], axis=-1)).to(dtype).contiguous()
        pairs = nibbles[:rows, 0::2] | (nibbles[:rows, 1::2] << 4)
        order = None if column_order is None else torch.from_numpy(np.asarray(column_order, dtype=np.int64))
        return cls(packed, scales_and_zeros, (rows, nibbles.shape[1]), torch.from_numpy(pairs), order)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @property
    def nbytes(self) -> int:
        order = 0 if self.column_order is None else _nbytes(self.column_order) + _nbytes(self.stored_column)
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros) + _nbytes(self.nibble_pairs) + order

    def kernels(self):
        rebuild = lambda start, stop, _out: self._stored(start, stop)  # noqa: E731
        found = {
            "int4_mm": self._int4_mm,
            "rebuild": lambda x: dense_matmul(x, self.shape, rebuild, INT4_SLICE_ELEMENTS),
        }
        if self.dtype != torch.float32:
            found["rebuild_f32"] = lambda x: dense_matmul(
                x.float(), self.shape, lambda start, stop, _out: self._stored(start, stop, torch.float32),
                INT4_SLICE_ELEMENTS).to(self.dtype)
        if self.column_order is None:
            return found
        return {name: _in_stored_order(kernel, self.column_order) for name, kernel in found.items()}

    def _int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return out if out.shape[-1] == self.shape[0] else out[:, : self.shape[0]].contiguous()

    def dense(self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values [stop - start, K] in the compute dtype (or `dtype`), in
        the weight's own column order."""
        stored = self._stored(start, stop, dtype)
        return stored if self.stored_column is None else stored.index_select(1, self.stored_column)

    def _stored(self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values with their columns in the stored order."""
        pairs = self.nibble_pairs[start:stop]
        return self._values(pairs, self.scales_and_zeros[:, start:start + pairs.shape[0]], dtype or self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [..., K] in the compute dtype (an embedding lookup)."""
        flat = ids.reshape(-1)
        values = self._values(self.nibble_pairs.index_select(0, flat), self.scales_and_zeros.index_select(1, flat),
                              self.dtype)
        if self.stored_column is not None:
            values = values.index_select(1, self.stored_column)
        return values.reshape(*ids.shape, self.shape[1])

    def _values(self, pairs: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, columns = pairs.shape[0], self.shape[1]
        nibbles = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(rows, -1, self.group_size)
        # in float32: a zero point cancels most of (q - 8) * scale, which bfloat16 arithmetic would blur
        groups = scales_and_zeros.transpose(0, 1).float()
        values = (nibbles.float() - 8) * groups[..., 0:1] + groups[..., 1:2]
        return values.reshape(rows, columns).to(dtype)


def _in_stored_order(kernel: Callable[[torch.Tensor], torch.Tensor], column_order: torch.Tensor):
    """`kernel` of a weight whose columns are stored permuted, taking x in the weight's own column order."""
    return lambda x: kernel(x.index_select(1, column_order))


class Int8Weight(KeptWeight):
    """A [N, K] weight as int8 values with one scale per output row, for x @ W.T."""

    form = "int8"

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        if values.shape[1] % INT8_COLUMN_STEP:
            raise ValueError(f"the int8 kernel takes widths in steps of {INT8_COLUMN_STEP}, got {values.shape[1]}")
        self.values = values  # int8 [N, K]
        self.scales = scales  # compute dtype [N]
        self.shape = (values.shape[0], values.shape[1])

    @classmethod
    def from_rows(cls, values: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> Int8Weight:
        """From `int8_rowwise`'s arrays, with scales rounded to `dtype`, the compute dtype."""
        return cls(torch.from_numpy(np.ascontiguousarray(values)), torch.from_numpy(scales).to(dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values) + _nbytes(self.scales)

    def kernels(self):
        found = {
            "int8_mm": lambda x: torch.ops.aten._weight_int8pack_mm(x, self.values, self.scales),
            "int8_split": lambda x: _int8_activation_matmul(x, self.values, self.scales),
            # int8 values are exact in bfloat16, so the slices are the values alone, and the row scales
            # are applied to the product, as the int8 kernel applies them
            "rebuild": lambda x: dense_matmul(
                x, self.shape, lambda start, stop, out: out.copy_(self.values[start:stop])).mul_(self.scales),
        }
        if self.dtype != torch.float32:
            found["rebuild_f32"] = lambda x: dense_matmul(
                x.float(), self.shape, lambda start, stop, out: out.copy_(self.values[start:stop]),
            ).mul_(self.scales.float()).to(self.dtype)
        return found

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [..., K] in the compute dtype (an embedding lookup)."""
        flat = ids.reshape(-1)
        values = self.values.index_select(0, flat).to(self.dtype) * self.scales.index_select(0, flat)[:, None]
        return values.reshape(*ids.shape, self.shape[1])

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weight's values [stop - start, K] in the compute dtype."""
        return self.values[start:stop].to(self.dtype) * self.scales[start:stop, None]


class DenseWeight(KeptWeight):
    """A [N, K] weight's values in the compute dtype; where that is not float32, also multiplied in
    float32, which a CPU without bfloat16 arithmetic runs several times faster."""

    form = "dense"

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.shape = (values.shape[0], values.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values)

    def kernels(self):
        found = {"dense": lambda x: F.linear(x, self.values)}
        if self.dtype != torch.float32:
            found["dense_f32"] = lambda x: F.linear(x.float(), self.values.float()).to(self.dtype)
        return found

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.values[start:stop]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.values)


def _int8_activation_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (values * scales[:, None]).T in x's dtype, on int8 dot products: x split into two
    int8 parts (`split_into_int8_parts`), both multiplying the weight in int32, exactly, in one
    torch._int_mm of 2M rows."""
    rows = x.shape[0]
    parts, part_scales = split_into_int8_parts(x.to(torch.float32, copy=True))
    out = torch.empty(rows, values.shape[0], dtype=x.dtype)
    step = max(INT8_COLUMN_STEP, PRODUCT_SLICE_ELEMENTS // (2 * rows) // INT8_COLUMN_STEP * INT8_COLUMN_STEP)
    for start in range(0, values.shape[0], step):
        stop = min(values.shape[0], start + step)
        product = torch._int_mm(parts, values[start:stop].T).float()
        out[:, start:stop] = add_scaled_parts(product, part_scales, product[:rows]).mul_(scales[start:stop].float())
    return out


def dense_matmul(x: torch.Tensor, shape: tuple[int, int], rebuild, slice_elements: int | None = None) -> torch.Tensor:
    """x [M, K] @ W.T through dense slices of W: `rebuild(start, stop, out)` gives rows start:stop of W,
    written into `out` (a slice of this thread's scratch buffer in x's dtype) where it can. Slices of
    `slice_elements`, else the whole weight where it fits the scratch buffer."""
    rows, columns = shape
    if slice_elements is None:
        slice_elements = rows * columns if rows * columns <= SCRATCH_ELEMENTS else SLICE_ELEMENTS
    step = max(1, slice_elements // columns)
    scratch = _scratch(x.dtype)

    def dense(start: int, stop: int) -> torch.Tensor:
        return rebuild(start, stop, scratch[: (stop - start) * columns].view(stop - start, columns))

    if step >= rows:
        return F.linear(x, dense(0, rows))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[:, start:stop] = x @ dense(start, stop).T
    return out


_SCRATCH = threading.local()


def _scratch(dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for dense slices. Made outside inference mode, so that it can be written in
    and out of it: a step runs under inference mode, pooling for embeddings does not."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    if dtype not in buffers:
        with torch.inference_mode(False):
            buffers[dtype] = torch.empty(SCRATCH_ELEMENTS, dtype=dtype)
    return buffers[dtype]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_into_int8_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x [M, K] (overwritten) to int8 parts [2M, K] and their scales float32 [2M, 1], with
    x = parts[:M] * scales[:M] + parts[M:] * scales[M:] to within 1/64516 of each row's largest |x|:
    the first part rounds x to 127 steps of that largest value, the second what the first left
    over, which is finer than bfloat16 rounds any value above 1/128 of it."""
    first, first_scale = _int8_rows(x)
    remainder = x.sub_(first * first_scale)
    second, second_scale = _int8_rows(remainder)
    return torch.cat([first, second]).to(torch.int8), torch.cat([first_scale, second_scale])


def add_scaled_parts(products: torch.Tensor, part_scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The float32 products [2M, N] of `split_into_int8_parts`'s parts, scaled by their part scales
    (in place) and the two halves added into `out` [M, N]."""
    products.mul_(part_scales)
    rows = products.shape[0] // 2
    return torch.add(products[:rows], products[rows:], out=out)


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded per row to integers in [-127, 127] (as float32) and the row scales [M, 1]."""
    scale = x.abs().amax(dim=1, keepdim=True).div_(127)
    scale = torch.where(scale > 0, scale, 1.0)
    return torch.round(x / scale), scale
