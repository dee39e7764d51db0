"""GGUF checkpoints (llama.cpp's format), presented as Hugging Face ones.

The header is read and checked when the file is opened (gguf_file); the configuration is
synthesized from its metadata (gguf_config) and tensor names are mapped to Hugging Face's
(gguf_tensors). Tensor data stays memory-mapped: `load` dequantizes one tensor per call (or the two
it is joined from), and `load_quantized` copies a quantized 2-D tensor's blocks as stored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from candelabra.core.contract.weights import QuantizedTensor
from candelabra.core.weights import Checkpoint
from candelabra.core.weights.gguf_config import synthesize_config
from candelabra.core.weights.gguf_file import DENSE_TYPES, GGUFFile, TensorInfo
from candelabra.core.weights.gguf_tensors import TensorRecipe, tensor_recipes


class GGUFCheckpoint(Checkpoint):
    """One .gguf file of a supported architecture (gguf_config.ARCHITECTURES)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = GGUFFile(self.path)
        try:
            self._config = synthesize_config(self._file)
            self._recipes = tensor_recipes(self._file, self._file.metadata["general.architecture"], self._config)
        except BaseException:
            self._file.close()
            raise

    @property
    def config(self) -> dict:
        return self._config

    @property
    def quant_method(self) -> str:
        return "gguf"

    @property
    def metadata(self) -> dict[str, object]:
        """The file's own metadata, by GGUF key (tokenizer string arrays are not decoded)."""
        return self._file.metadata

    def tensor_names(self) -> list[str]:
        return list(self._recipes)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._recipe(name).shape

    def gguf_name(self, name: str) -> str:
        """The name of the GGUF tensor this tensor is read from."""
        return self._recipe(name).source

    def gguf_type(self, name: str) -> str:
        """How the file stores the tensor ("Q4_K", "F32", ...)."""
        return self._file.tensors[self._recipe(name).source].ggml_type.name

    def load(self, name: str) -> np.ndarray:
        recipe = self._recipe(name)
        info = self._file.tensors[recipe.source]
        if recipe.joined is not None:
            return recipe.join(self._whole(info), self._whole(self._file.tensors[recipe.joined]))
        if recipe.rows is None:
            weights = self._whole(info)
        elif len(info.shape) == 1:
            start, stop = recipe.rows
            weights = self._file.read_rows(info)[0, start:stop].copy()
        else:
            weights = self._file.read_rows(info, *recipe.rows)
        weights = weights.reshape(recipe.shape)
        if recipe.reorder_rows is not None:
            weights = recipe.reorder_rows(weights)
        return weights if recipe.fix is None else recipe.fix(weights)

    def quantized_format(self, name: str) -> str | None:
        recipe = self._recipe(name)
        ggml_type = self._file.tensors[recipe.source].ggml_type
        if ggml_type in DENSE_TYPES or len(recipe.shape) != 2 or recipe.fix is not None or recipe.joined:
            return None
        return ggml_type.name

    def load_quantized(self, name: str) -> QuantizedTensor:
        format = self.quantized_format(name)
        if format is None:
            return super().load_quantized(name)
        recipe = self._recipe(name)
        info = self._file.tensors[recipe.source]
        blocks = self._file.read_blocks(info, *(recipe.rows or ()))
        if recipe.reorder_rows is not None:
            blocks = recipe.reorder_rows(blocks)
        return QuantizedTensor(format, blocks, recipe.shape)

    def _whole(self, info: TensorInfo) -> np.ndarray:
        return self._file.read_rows(info).reshape(info.shape)

    def _recipe(self, name: str) -> TensorRecipe:
        if name not in self._recipes:
            raise KeyError(f"no tensor {name!r} in {self.path}")
        return self._recipes[name]

    def tokenizer_files(self) -> dict:
        return {"pretrained_model_name_or_path": str(self.path.parent), "gguf_file": self.path.name}

    def release_pages(self) -> None:
        self._file.release_pages()

    def close(self) -> None:
        self._file.close()
