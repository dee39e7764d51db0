"""Hugging Face safetensors checkpoints: a model folder with config.json and one
`model.safetensors`, or the shards that `model.safetensors.index.json` lists.

Headers are parsed and validated when the checkpoint is opened; tensor data is memory-mapped and
read one tensor per `load` call, so the caller can wrap a progress bar around its own loop:

    for name in tqdm(checkpoint.tensor_names()):
        weights[name] = backend.upload(checkpoint.load(name))

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor to
its dtype, shape and [begin, end) byte offsets into the data that follows, then the data.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import numpy as np

from candelabra.core.contract.weights import QuantizedTensor
from candelabra.core.weights import Checkpoint, CheckpointError
from candelabra.core.weights.int4_config import read_int4_scheme
from candelabra.core.weights.int4_linears import Int4Linears
from candelabra.core.weights.mapped_file import MappedFile

log = logging.getLogger("candelabra")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

MAX_HEADER_BYTES = 100_000_000

# Little-endian numpy dtypes; None marks types whose size is known but that load() cannot convert.
DTYPES: dict[str, np.dtype | None] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": None,
    "F8_E5M2": None,
}
ITEM_SIZES = {name: (dtype.itemsize if dtype is not None else 1) for name, dtype in DTYPES.items()}


class TensorEntry:
    """Where one tensor lies in its file."""

    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


class SafetensorsFile:
    """One .safetensors file: its validated header at once, its data memory-mapped on first load."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data_start, self.entries = read_header(self.path)
        self._mapped: MappedFile | None = None

    def load(self, name: str) -> np.ndarray:
        return self.load_stored(name, float32=True)

    def load_stored(self, name: str, float32: bool = False) -> np.ndarray:
        """A copy of the tensor: float32 with `float32`, else in its stored dtype (integers as they are;
        BF16, which numpy lacks, as float32)."""
        entry = self.entries[name]
        raw_dtype = DTYPES[entry.dtype]
        if raw_dtype is None:
            problem = f"tensor {name!r} is {entry.dtype}, which is not supported; use a BF16, F16 or F32 checkpoint"
            raise CheckpointError(self.path, problem)
        mapped = self._mapped_file()
        if not mapped.holds(self.data_start + entry.end):
            raise CheckpointError(self.path, f"tensor {name!r} ends past the end of the file (truncated since opened?)")
        count = (entry.end - entry.begin) // raw_dtype.itemsize
        raw = np.frombuffer(mapped.map, dtype=raw_dtype, count=count, offset=self.data_start + entry.begin)
        if float32 or entry.dtype == "BF16":
            return to_float32(raw, entry.dtype).reshape(entry.shape)
        return raw.astype(raw_dtype.newbyteorder("="), copy=True).reshape(entry.shape)

    def _mapped_file(self) -> MappedFile:
        if self._mapped is None:
            try:
                self._mapped = MappedFile(self.path)
            except (OSError, ValueError) as error:
                raise CheckpointError(self.path, f"cannot be memory-mapped: {one_line(error)}") from None
        return self._mapped

    def release_pages(self) -> None:
        if self._mapped is not None:
            self._mapped.release_pages()

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 copy of `raw`, never a view into the memory map."""
    if dtype == "BF16":
        # A bfloat16 is the top 16 bits of the float32 with the same value.
        widened = raw.astype(np.uint32)
        widened <<= 16
        return widened.view(np.float32)
    return raw.astype(np.float32)


def read_header(path: Path) -> tuple[int, dict[str, TensorEntry]]:
    """The offset where tensor data starts, and every tensor's validated entry."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CheckpointError(path, f"is {file_size} bytes, too short for a safetensors file")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES:
                raise CheckpointError(
                    path, f"claims a {header_size}-byte header (limit {MAX_HEADER_BYTES}); not a safetensors file?"
                )
            if 8 + header_size > file_size:
                problem = f"claims a {header_size}-byte header but is only {file_size} bytes; truncated?"
                raise CheckpointError(path, problem)
            header_bytes = file.read(header_size)
    except OSError as error:
        raise CheckpointError(path, f"cannot be read: {error.strerror or error}") from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"header is not valid JSON ({one_line(error)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, f"header is a JSON {type(header).__name__}, expected an object of tensors")
    data_size = file_size - 8 - header_size
    entries = {name: parse_entry(path, name, value) for name, value in header.items() if name != "__metadata__"}
    check_layout(path, entries, data_size)
    return 8 + header_size, entries


def parse_entry(path: Path, name: str, value: object) -> TensorEntry:
    if not isinstance(value, dict):
        raise CheckpointError(path, f"header entry {name!r} is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPES:
        known = ", ".join(DTYPES)
        raise CheckpointError(path, f"tensor {name!r} has unknown dtype {dtype!r}; known dtypes: {known}")
    if not isinstance(shape, list) or not all(is_natural(dim) for dim in shape):
        raise CheckpointError(path, f"tensor {name!r} has shape {shape!r}, expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_natural(offset) for offset in offsets):
        raise CheckpointError(path, f"tensor {name!r} has data_offsets {offsets!r}, expected [begin, end] in bytes")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(path, f"tensor {name!r} has data_offsets [{begin}, {end}] that run backwards")
    expected = ITEM_SIZES[dtype]
    for dim in shape:
        expected *= dim
    if expected != end - begin:
        raise CheckpointError(
            path, f"tensor {name!r} is {dtype} {shape} ({expected} bytes) but its data_offsets span {end - begin} bytes"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def check_layout(path: Path, entries: dict[str, TensorEntry], data_size: int) -> None:
    """Every tensor lies inside the data section, and no two overlap."""
    previous_name, previous_end = None, 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.end > data_size:
            problem = f"tensor {name!r} ends at data byte {entry.end} but the file holds {data_size}; truncated?"
            raise CheckpointError(path, problem)
        if entry.begin < previous_end:
            raise CheckpointError(path, f"tensors {previous_name!r} and {name!r} overlap in the data section")
        if entry.end > entry.begin:
            previous_name, previous_end = name, entry.end


def is_natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def read_json_object(path: Path, expected: str) -> dict:
    """A JSON file that must hold an object, or one CheckpointError saying why it does not."""
    if not path.is_file():
        raise CheckpointError(path, f"missing; {expected}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(path, f"cannot be read: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"is not valid JSON ({one_line(error)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, f"holds a JSON {type(value).__name__}, expected an object")
    return value


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face model folder in safetensors form, or one .safetensors file whose folder holds
    config.json. Tensors keep their Hugging Face names and layout; `load` returns float32. A GPTQ or
    AWQ checkpoint's quantized linears are presented as their weights (see `int4_linears`), handed
    over in grouped int4 formats by `load_quantized`."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(path, "does not exist; pass a Hugging Face model folder or a .safetensors file")
        self.path = path
        folder = path.parent if path.is_file() else path
        self.folder = folder
        self._config = read_json_object(
            folder / CONFIG_FILE, "a Hugging Face model folder needs its config.json next to the weights"
        )
        self._files: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        try:
            if path.is_file():
                self._add_whole_file(path)
            elif (folder / INDEX_FILE).is_file():
                self._add_shards(folder / INDEX_FILE)
            elif (folder / SINGLE_FILE).is_file():
                self._add_whole_file(folder / SINGLE_FILE)
            else:
                raise CheckpointError(folder, no_weights_problem(folder))
            self._int4 = self._int4_linears()
        except BaseException:
            self.close()
            raise
        self._names = self._presented_names()

    def _int4_linears(self) -> Int4Linears | None:
        """The GPTQ or AWQ linears, where config.json (or quantize_config.json) says the checkpoint has them."""
        scheme = read_int4_scheme(self._config, self.folder)
        packed = next((name for name in self._where if name.endswith(".qweight")), None)
        if scheme is None:
            if packed is not None:
                raise CheckpointError(self.folder, f"holds {packed}, a GPTQ or AWQ tensor, but no quantization_config "
                                                   "in config.json nor a quantize_config.json saying how it is packed")
            return None
        try:
            linears = Int4Linears(scheme, self._where, self._stored_shape, self._load_stored)
        except ValueError as error:
            raise CheckpointError(self.folder, str(error)) from None
        log.info("%s: %d linear weights in %s", self.folder, len(linears.weight_names()), scheme.describe())
        return linears

    def _presented_names(self) -> list[str]:
        """The stored tensors' names, each quantized linear's parts presented as its one weight."""
        if self._int4 is None:
            return list(self._where)
        names = [f"{name.removesuffix('.qweight')}.weight" if name.endswith(".qweight") else name
                 for name in self._where]
        return [name for name in names if name not in self._int4.parts]

    def _add_whole_file(self, path: Path) -> None:
        file = SafetensorsFile(path)
        self._files.append(file)
        self._where = dict.fromkeys(file.entries, file)

    def _add_shards(self, index_path: Path) -> None:
        weight_map = read_json_object(index_path, "").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise CheckpointError(index_path, 'has no "weight_map" object mapping tensor names to shard files')
        shards: dict[str, SafetensorsFile] = {}
        for shard_name in dict.fromkeys(weight_map.values()):
            shard_path = index_path.parent / shard_name
            if not shard_path.is_file():
                raise CheckpointError(index_path, f"lists shard {shard_name!r}, which is not in {index_path.parent}")
            shards[shard_name] = SafetensorsFile(shard_path)
            self._files.append(shards[shard_name])
        for name, shard_name in weight_map.items():
            if name not in shards[shard_name].entries:
                raise CheckpointError(index_path, f"places tensor {name!r} in {shard_name!r}, which does not hold it")
            self._where[name] = shards[shard_name]

    @property
    def config(self) -> dict:
        return self._config

    @property
    def quant_method(self) -> str | None:
        return None if self._int4 is None else self._int4.scheme.method

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        if self._int4 is not None and name in self._int4:
            return self._int4.shape(name)
        return self._stored_shape(name)

    def load(self, name: str) -> np.ndarray:
        if self._int4 is not None and name in self._int4:
            weight = self._int4.load(name)
            return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        return self._file_of(name).load(name)

    def quantized_format(self, name: str) -> str | None:
        return self._int4.format(name) if self._int4 is not None and name in self._int4 else None

    def load_quantized(self, name: str) -> QuantizedTensor:
        weight = self._int4.load(name) if self.quantized_format(name) is not None else None
        return weight if isinstance(weight, QuantizedTensor) else super().load_quantized(name)

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return self._file_of(name).entries[name].shape

    def _load_stored(self, name: str) -> np.ndarray:
        return self._file_of(name).load_stored(name)

    def _file_of(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.path}")
        return self._where[name]

    def tokenizer_files(self) -> dict:
        return {"pretrained_model_name_or_path": str(self.folder)}

    def release_pages(self) -> None:
        for file in self._files:
            file.release_pages()

    def close(self) -> None:
        for file in self._files:
            file.close()


def no_weights_problem(folder: Path) -> str:
    others = sorted(entry.name for entry in folder.glob("*.safetensors")) if folder.is_dir() else []
    hint = f"; to use one of {', '.join(others)}, pass it as --weight-file" if others else ""
    return f"holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}"


def is_safetensors_folder(folder: Path) -> bool:
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()
