"""Checkpoints: a model's configuration and tensors, whatever the file format.

Every format presents the same view: a Hugging Face `config.json`-style dict, and tensors named,
shaped and laid out as Hugging Face transformers names them ("model.layers.0.self_attn.q_proj.weight",
[out_features, in_features]), dequantized to float32 numpy arrays. Model graphs therefore know
one naming scheme only. A checkpoint that stores a 2-D tensor quantized (GGUF, GPTQ, AWQ) can also
hand it over quantized (`quantized_format`, `load_quantized`), for backends that keep that format.
"""

from __future__ import annotations

import abc
from pathlib import Path

import numpy as np

from candelabra.core.contract.weights import QuantizedTensor


class CheckpointError(ValueError):
    """A checkpoint that cannot be read. The message is one line naming the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


class Checkpoint(abc.ABC):
    """One model's weights and configuration, opened for reading."""

    path: Path

    @property
    @abc.abstractmethod
    def config(self) -> dict:
        """The model's configuration as a Hugging Face config.json dict."""

    @abc.abstractmethod
    def tensor_names(self) -> list[str]:
        """Every tensor, by its Hugging Face name."""

    @abc.abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape `load(name)` will return, without reading the data."""

    @abc.abstractmethod
    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy, dequantized and in Hugging Face layout. Raises KeyError
        naming the tensor and the file when it is absent."""

    @property
    def quant_method(self) -> str | None:
        """How the checkpoint itself is quantized: "gguf", "gptq", "awq", or None for a dense one."""
        return None

    def quantized_format(self, name: str) -> str | None:
        """The quantized format ("Q4_K", "INT4_G128") `load_quantized(name)` hands the tensor over in, or None
        when it can only be loaded dense."""
        return None

    def load_quantized(self, name: str) -> QuantizedTensor:
        """The tensor still quantized, as stored, in Hugging Face layout (rows in Hugging Face's
        order). Only for a tensor whose `quantized_format` is not None."""
        raise ValueError(f"tensor {name!r} in {self.path} is not stored quantized")

    @abc.abstractmethod
    def tokenizer_files(self) -> dict:
        """Keyword arguments for transformers.AutoTokenizer.from_pretrained that load this
        checkpoint's own tokenizer (e.g. {"pretrained_model_name_or_path": dir} or, for GGUF,
        {"pretrained_model_name_or_path": dir, "gguf_file": name})."""

    def close(self) -> None:
        """Release open files and memory maps."""

    def release_pages(self) -> None:
        """Drop the pages of mapped files that reading tensors brought into this process's memory
        (they stay in the OS's page cache); a later read maps them in again. Called once the model
        is loaded: the backend holds its own copies, and a mapped GGUF file otherwise stays in the
        server's resident memory, 480 MB of it for the default model."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
