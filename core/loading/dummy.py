"""Random weights shaped by a config.json (`--load-format dummy`), for benchmarks without a checkpoint.

`DummyCheckpoint` lists every tensor the model's family loads for the config (see `model_tensors`)
and draws each one when it is loaded, from a numpy Generator seeded by the seed and the tensor's
name: the same tensor every time, nothing held in memory between loads. Values are sized as a
trained model's are, so activations stay finite through every layer: matrices normal with
standard deviation 0.02, norm weights 1 plus that noise (0 plus it for Gemma's 1 + w norms),
biases that noise alone. With `quantization` ("Q4_K", ...) linear and LM-head weights whose
width fills whole blocks are random blocks of that GGUF format, handed over still quantized.

The tokenizer is the folder's own when it has tokenizer files; otherwise a byte-level stand-in
(see `stand_in_tokenizer`): completions and chat work, on bytes in and placeholder text out.
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from math import prod
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.core.contract.weights import (
    INT4_GROUP_FORMATS,
    QUANTIZABLE_ROLES,
    QUANTIZED_FORMATS,
    QuantizedTensor,
    WeightRole,
)
from candelabra.core.loading.model_tensors import TensorSpec, model_tensors
from candelabra.core.weights import Checkpoint, CheckpointError
from candelabra.core.weights.safetensors import read_json_object

log = logging.getLogger("candelabra")

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
STD = 0.02
# Each tensor is drawn in chunks of this many values, each from its own seeded stream, so that
# threads can share the work and the values do not depend on how many there are.
CHUNK = 1 << 20


class DummyCheckpoint(Checkpoint):
    """Random weights for the config.json at `folder_or_config_json` (a folder holding one, or the
    file itself). `seed` picks the weights; `quantization` is a quantized GGUF format or None."""

    def __init__(self, folder_or_config_json: str | Path, seed: int = 0, quantization: str | None = None) -> None:
        path = Path(folder_or_config_json).expanduser()
        config_file = path / CONFIG_FILE if path.is_dir() else path
        if not config_file.is_file() or config_file.suffix != ".json":
            where = (f"holds no {CONFIG_FILE}" if path.is_dir() else "is not a config.json" if path.is_file()
                     else "does not exist")
            raise CheckpointError(path, f"{where}; --load-format dummy draws random weights in the shapes a "
                                        "Hugging Face config.json gives, so pass a folder holding one, or the file")
        self.path = self.folder = config_file.parent
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"the dummy weights' seed must be a non-negative integer, not {seed!r}")
        self.seed = seed
        self.quantization = check_dummy_quantization(quantization)
        self._config = read_json_object(config_file, "--load-format dummy reads the model's shapes from it")
        self._model_config, self._family = _model_config_and_family(self._config, config_file)
        self._tensors = model_tensors(self._model_config, self._family)

    @property
    def config(self) -> dict:
        return self._config

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._spec(name).shape

    def parameter_count(self) -> int:
        """How many values the weights hold, counted from the shapes alone."""
        return sum(prod(spec.shape) for spec in self._tensors.values())

    def load(self, name: str) -> np.ndarray:
        spec = self._spec(name)
        if self.quantized_format(name) is not None:
            return self.load_quantized(name).dequantize()
        values = _standard_normal(_seed_of(self.seed, name), spec.shape)
        values *= STD
        if spec.role is WeightRole.NORM:
            values += 1.0 - self._family.norm_offset  # the weight the norm multiplies by is then near 1
        return values

    def quantized_format(self, name: str) -> str | None:
        spec = self._spec(name)
        if self.quantization is None or spec.role not in QUANTIZABLE_ROLES:
            return None
        values_per_block = INT4_GROUP_FORMATS.get(self.quantization) or \
            GGML_QUANT_SIZES[GGMLQuantizationType[self.quantization]][0]
        return self.quantization if spec.shape[1] % values_per_block == 0 else None

    def load_quantized(self, name: str) -> QuantizedTensor:
        from candelabra.core.weights.random_quantized import random_quantized

        if self.quantized_format(name) is None:
            return super().load_quantized(name)
        rows, columns = self._spec(name).shape
        rng = np.random.default_rng(_seed_of(self.seed, name))
        return random_quantized(rng, self.quantization, rows, columns, rms=STD)

    def tokenizer_files(self) -> dict:
        if any((self.folder / name).is_file() for name in TOKENIZER_FILES):
            return {"pretrained_model_name_or_path": str(self.folder)}
        from candelabra.core.weights.default_model import default_cache_dir
        from candelabra.core.weights.stand_in_tokenizer import stand_in_tokenizer_folder

        config = self._model_config
        log.warning("%s has no tokenizer files: using a byte-level stand-in tokenizer (one token per byte of "
                    "text, generated tokens read as <id> placeholders, a plain 'role: content' chat template); "
                    "put the model's tokenizer.json and tokenizer_config.json there for real text", self.folder)
        folder = stand_in_tokenizer_folder(config.vocab_size, config.bos_token_id, config.eos_token_ids,
                                           default_cache_dir())
        return {"pretrained_model_name_or_path": str(folder)}

    def _spec(self, name: str) -> TensorSpec:
        if name not in self._tensors:
            raise KeyError(f"no tensor {name!r} in the dummy weights for {self.folder / CONFIG_FILE}")
        return self._tensors[name]


def check_dummy_quantization(quantization: str | None) -> str | None:
    """The quantized format `quantization` names, in any case ("q4_k": "Q4_K"): a GGUF one, or the
    grouped int4 GPTQ and AWQ checkpoints load as (INT4_G128, ...); None for None. ValueError in one
    line, saying which formats there are, for anything else."""
    if quantization is None:
        return None
    if quantization.upper() not in QUANTIZED_FORMATS:
        raise ValueError(f"--dummy-quantization {quantization} is not a quantized GGUF format or grouped int4 "
                         f"(GPTQ's, AWQ's); choose one of {', '.join(QUANTIZED_FORMATS)}")
    return quantization.upper()


def _model_config_and_family(config: dict, config_file: Path):
    """The parsed config, and the model class registered for its architecture."""
    from candelabra.core.models.config import ConfigError, ModelConfig
    from candelabra.plugins import RegistryError, installed_plugins

    try:
        model_config = ModelConfig.from_hf(config)
        return model_config, installed_plugins().model_architectures.get(model_config.architecture)
    except (ConfigError, RegistryError) as exc:
        raise CheckpointError(config_file, str(exc)) from None


def _seed_of(seed: int, name: str) -> np.random.SeedSequence:
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:16], "little")
    return np.random.SeedSequence([seed, digest])


def _standard_normal(seed: np.random.SeedSequence, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float32 values of `shape`, chunk i from the i-th child stream of `seed`."""
    out = np.empty(prod(shape), np.float32)
    starts = range(0, out.size, CHUNK)

    def fill(index_and_start):
        index, start = index_and_start
        child = np.random.SeedSequence(seed.entropy, spawn_key=(index,))
        np.random.default_rng(child).standard_normal(out=out[start : start + CHUNK], dtype=np.float32)

    if len(starts) == 1:
        fill((0, 0))
    else:
        with ThreadPoolExecutor(max_workers=min(len(starts), os.cpu_count() or 1)) as pool:
            list(pool.map(fill, enumerate(starts)))
    return out.reshape(shape)
