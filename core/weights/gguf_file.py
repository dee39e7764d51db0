"""One GGUF file: its header parsed and checked against the file's length, its tensor data
memory-mapped and dequantized a range of rows at a time.

A GGUF file is a magic word and version, a count of tensors and of metadata entries, the
metadata (typed key/value pairs), one info record per tensor (name, dims, type, offset), then
the aligned data section. Every length and count is checked against the bytes that remain
before anything is read or allocated, so a truncated or lying file fails at once with a
CheckpointError instead of a hang, a huge allocation or a crash on an unmapped page.

gguf's own GGUFReader is not used: it trusts the counts it reads (a lying array length can
make it loop for ever) and it builds numpy views for every tokenizer string, which takes over
ten seconds on a real model. This reader skips the string arrays it does not need; its
constants and dequantization come from the gguf package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from candelabra.core.weights import CheckpointError
from candelabra.core.weights.mapped_file import MappedFile

SUPPORTED_VERSIONS = (2, 3)
Q = GGMLQuantizationType
DEQUANTIZABLE_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
DENSE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})  # the rest are block formats
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ENTRIES = 1_000_000  # metadata entries or tensors; real files hold thousands at most
MAX_NAME_BYTES = 65_535

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NUMPY_TYPES = {value_type: np.dtype(fmt) for value_type, fmt in _SCALAR_FORMATS.items()}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class SkippedStrings:
    """A metadata array of strings (a tokenizer's vocabulary or merges) checked but not decoded."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"SkippedStrings({self.length})"


# Metadata string arrays at most this long are decoded; longer ones become SkippedStrings.
MAX_DECODED_STRINGS = 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies and how it is encoded. `dims` are in GGUF order (innermost first)."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy, Hugging Face) order: the reverse of GGUF's."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.dims[0] // block_size * type_size

    @property
    def n_rows(self) -> int:
        return prod(self.dims[1:])


class GGUFFile:
    """A GGUF file opened for reading: `metadata`, `tensors` by GGUF name, and `read_rows`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mapped: MappedFile | None = None
        try:
            self._mapped = MappedFile(self.path)
            if self._mapped.size == 0:
                raise CheckpointError(self.path, "is empty; expected a GGUF file")
            parser = _HeaderParser(self.path, self._mapped.map)
            self.metadata, self.tensors, self.data_start = parser.parse()
            self._entry_spans = parser.entry_spans
        except OSError as error:
            self.close()
            raise CheckpointError(self.path, f"cannot be read: {error.strerror or error}") from None
        except BaseException:
            self.close()
            raise

    def metadata_entry(self, key: str) -> bytes:
        """The metadata entry for `key` as the file stores it (key, value type and value, string
        arrays included), for a digest of values this reader does not decode."""
        start, end = self._entry_spans[key]
        if self._mapped is None:
            raise CheckpointError(self.path, "is closed; open it again to read its metadata")
        return bytes(self._mapped.map[start:end])

    def read_rows(self, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of the tensor (its row-major layout's leading dims, flattened),
        dequantized to a float32 array of shape [stop - start, dims[0]], never a view of the map."""
        stop = info.n_rows if stop is None else stop
        raw = self._mapped_rows(info, start, stop)
        try:
            rows = dequantize(raw, info.ggml_type)
        except (ValueError, NotImplementedError) as error:
            raise CheckpointError(self.path, f"tensor {info.name!r} cannot be dequantized: {error}") from None
        if np.may_share_memory(rows, raw):
            rows = rows.copy()
        return rows.astype(np.float32, copy=False).reshape(stop - start, info.dims[0])

    def read_blocks(self, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of the tensor as stored: a uint8 copy of shape
        [stop - start, row_bytes], never a view of the map."""
        stop = info.n_rows if stop is None else stop
        return self._mapped_rows(info, start, stop).copy()

    def _mapped_rows(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        begin = info.offset + start * info.row_bytes
        count = (stop - start) * info.row_bytes
        if self._mapped is None:
            raise CheckpointError(self.path, "is closed; open the checkpoint again to load tensors")
        if not self._mapped.holds(begin + count):
            problem = f"tensor {info.name!r} ends past the end of the file (truncated since opened?)"
            raise CheckpointError(self.path, problem)
        raw = np.frombuffer(self._mapped.map, dtype=np.uint8, count=count, offset=begin)
        return raw.reshape(stop - start, info.row_bytes)

    def release_pages(self) -> None:
        if self._mapped is not None:
            self._mapped.release_pages()

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None


class _HeaderParser:
    """Walks the header once, checking each read against the file's length."""

    def __init__(self, path: Path, data: mmap.mmap) -> None:
        self.path, self.data, self.size, self.pos = path, data, len(data), 0
        self.entry_spans: dict[str, tuple[int, int]] = {}  # metadata key -> where its entry lies

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, problem)

    def parse(self) -> tuple[dict[str, object], dict[str, TensorInfo], int]:
        self._check_magic_and_version()
        tensor_count = self._count("tensors", _MIN_TENSOR_INFO_BYTES)
        kv_count = self._count("metadata entries", _MIN_KV_BYTES)
        metadata: dict[str, object] = {}
        for _ in range(kv_count):
            start = self.pos
            key = self._string("a metadata key")
            if key in metadata:
                raise self.fail(f"repeats metadata key {key!r}")
            metadata[key] = self._value(key, self._u32())
            self.entry_spans[key] = (start, self.pos)
        raw_infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self._alignment(metadata)
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, relative_offset in raw_infos:
            if name in tensors:
                raise self.fail(f"holds two tensors named {name!r}")
            tensors[name] = self._check_tensor(name, dims, ggml_type, relative_offset, data_start, alignment)
        return metadata, tensors, data_start

    def _check_magic_and_version(self) -> None:
        magic = bytes(self.data[:4])
        if len(magic) < 4 or struct.unpack("<I", magic)[0] != GGUF_MAGIC:
            raise self.fail(f"is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        self.pos = 4
        version = self._u32()
        if version & 0xFFFF == 0 and struct.unpack(">I", struct.pack("<I", version))[0] in SUPPORTED_VERSIONS:
            raise self.fail("is a big-endian GGUF file, which candelabra cannot read; convert it little-endian")
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"is GGUF version {version}; candelabra reads versions 2 and 3 (re-convert with llama.cpp)")

    def _count(self, field: str, min_bytes_each: int) -> int:
        count = self._u64()
        if count > MAX_ENTRIES or count * min_bytes_each > self.size - self.pos:
            raise self.fail(f"claims {count} {field}, more than its {self.size} bytes can hold; corrupted header?")
        return count

    def _take(self, n_bytes: int, field: str) -> int:
        """Advance past `n_bytes` and return where they start, or fail if the file ends first."""
        start = self.pos
        if n_bytes > self.size - start:
            problem = f"ends inside {field} ({n_bytes} bytes from offset {start}; the file has {self.size}); truncated?"
            raise self.fail(problem)
        self.pos = start + n_bytes
        return start

    def _unpack(self, fmt: str, field: str):
        return struct.unpack_from(fmt, self.data, self._take(struct.calcsize(fmt), field))[0]

    def _u32(self) -> int:
        return self._unpack("<I", "the header")

    def _u64(self) -> int:
        return self._unpack("<Q", "the header")

    def _string(self, field: str, limit: int | None = MAX_NAME_BYTES) -> str:
        length = self._u64()
        if limit is not None and length > limit:
            raise self.fail(f"claims a {length}-byte string for {field} (at most {limit}); corrupted header?")
        start = self._take(length, field)
        try:
            return bytes(self.data[start : start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"holds {field} that is not valid UTF-8 at offset {start}") from None

    def _value(self, key: str, raw_type: int) -> object:
        value_type = self._value_type(key, raw_type)
        if value_type == GGUFValueType.STRING:
            return self._string(f"the value of {key!r}", limit=None)
        if value_type != GGUFValueType.ARRAY:
            return self._unpack(_SCALAR_FORMATS[value_type], f"the value of {key!r}")
        element_type = self._value_type(key, self._u32())
        length = self._u64()
        if element_type == GGUFValueType.ARRAY:
            raise self.fail(f"metadata {key!r} is an array of arrays, which GGUF readers do not support")
        if element_type == GGUFValueType.STRING:
            return self._string_array(key, length)
        dtype = _NUMPY_TYPES[element_type]
        start = self._take(length * dtype.itemsize, f"the array {key!r} ({length} items)")
        return np.frombuffer(self.data, dtype=dtype, count=length, offset=start).copy()

    def _value_type(self, key: str, raw_type: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw_type)
        except ValueError:
            raise self.fail(f"metadata {key!r} has unknown value type {raw_type}; corrupted header?") from None

    def _string_array(self, key: str, length: int) -> list[str] | SkippedStrings:
        if length * 8 > self.size - self.pos:
            raise self.fail(f"claims {length} strings for {key!r}, more than the file can hold; truncated?")
        if length <= MAX_DECODED_STRINGS:
            return [self._string(f"an item of {key!r}", limit=None) for _ in range(length)]
        for _ in range(length):
            (item_length,) = struct.unpack_from("<Q", self.data, self._take(8, f"the array {key!r}"))
            self._take(item_length, f"an item of {key!r}")
        return SkippedStrings(length)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", self.data, self._take(8 * n_dims, f"the dims of tensor {name!r}"))
        ggml_type = self._u32()
        offset = self._u64()
        return name, dims, ggml_type, offset

    def _alignment(self, metadata: dict[str, object]) -> int:
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"has general.alignment {alignment!r}; it must be a power of two")
        return alignment

    def _check_tensor(
        self, name: str, dims: tuple[int, ...], raw_type: int, relative_offset: int, data_start: int, alignment: int
    ) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(f"tensor {name!r} has unknown type {raw_type}; corrupted header?") from None
        if ggml_type not in DEQUANTIZABLE_TYPES:
            supported = ", ".join(sorted(t.name for t in DEQUANTIZABLE_TYPES))
            raise self.fail(
                f"tensor {name!r} is {ggml_type.name}, which candelabra cannot dequantize; "
                f"use a GGUF quantized with one of {supported}"
            )
        if 0 in dims:
            raise self.fail(f"tensor {name!r} has an empty dimension (dims {list(dims)})")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims[0] % block_size:
            problem = f"tensor {name!r} has rows of {dims[0]} values, not a multiple of {ggml_type.name}'s {block_size}"
            raise self.fail(problem)
        n_bytes = prod(dims) // block_size * type_size
        offset = data_start + relative_offset
        if relative_offset % alignment:
            raise self.fail(f"tensor {name!r} starts at data offset {relative_offset}, not a multiple of {alignment}")
        if offset + n_bytes > self.size:
            raise self.fail(
                f"tensor {name!r} ({ggml_type.name} {list(dims)}, {n_bytes} bytes at offset {offset}) "
                f"ends past the end of the file ({self.size} bytes); truncated?"
            )
        return TensorInfo(name, ggml_type, tuple(dims), offset, n_bytes)
