"""In-situ quantization (`--isq FORMAT`, candle-vllm's `--quant q4k`): a dense checkpoint whose
linear weights are quantized into a GGML format as they load, then handled as a GGUF file's are.

`InSituQuantized` wraps the dense checkpoint. Each weight of the roles `Ops.linear` multiplies by
(linear and the LM head, which is the embedding table where the model ties them) is quantized with
our own quantizers (`candelabra.core.weights.quantize`) when the loader reads it, and handed over as
a `QuantizedTensor` to a backend that keeps the format, dequantized to every other: all backends
then run the same quantized model. A weight whose in_features are not whole blocks of the format
falls back to Q8_0 (blocks of 32), as candle-vllm does, and stays dense where they are not whole
blocks of 32 either. Routers of mixture-of-experts layers stay dense, as GGUF files keep them:
choosing experts is sensitive to small changes in its scores.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QuantizedTensor, WeightRole
from candelabra.core.weights import Checkpoint, CheckpointError
from candelabra.core.weights.quantize import BLOCK_QUANTIZERS, quantize, values_per_block

FALLBACK_FORMAT = "Q8_0"
# candle-vllm's names (q4k), then GGML's (Q4_K, q4_k), for each format.
ISQ_NAMES: dict[str, str] = {
    **{format.lower().replace("_k", "k"): format for format in BLOCK_QUANTIZERS},
    **{format.lower(): format for format in BLOCK_QUANTIZERS},
}


def isq_format(name: str, flag: str = "--isq") -> str:
    """The GGML format `name` means (q4k, Q4_K and q4_k all mean Q4_K); ValueError naming `flag` and
    the choices for anything else."""
    if name.lower() in ISQ_NAMES:
        return ISQ_NAMES[name.lower()]
    choices = ", ".join(name for name in ISQ_NAMES if "_k" not in name)
    raise ValueError(f"{flag} {name} is not a format in-situ quantization makes; choose one of {choices} "
                     "(or a GGML name such as Q4_K)")


class InSituQuantized(Checkpoint):
    """`dense`'s tensors, its linear weights quantized to `format` (a GGML type name) as they are read."""

    def __init__(self, dense: Checkpoint, format: str) -> None:
        self.format = isq_format(format)
        self.dense, self.path = dense, dense.path
        _check_dense(dense, self.format)
        self._plan = quantization_plan(dense, self.format)
        self._last: tuple[str, QuantizedTensor] | None = None
        self.seconds = 0.0
        self.quantized: Counter[str] = Counter()

    @property
    def config(self) -> dict:
        return self.dense.config

    def tensor_names(self) -> list[str]:
        return self.dense.tensor_names()

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.dense.tensor_shape(name)

    def load(self, name: str) -> np.ndarray:
        if self._plan.get(name) is None:
            return self.dense.load(name)
        return self.load_quantized(name).dequantize()

    def quantized_format(self, name: str) -> str | None:
        return self._plan.get(name)

    def load_quantized(self, name: str) -> QuantizedTensor:
        """The tensor quantized; the last one is kept, as a tied LM head is read twice (dequantized for
        the embedding, then quantized)."""
        format = self._plan.get(name)
        if format is None:
            return super().load_quantized(name)
        if self._last is None or self._last[0] != name:
            start = time.perf_counter()
            self._last = name, quantize(self.dense.load(name), format)
            self.seconds += time.perf_counter() - start
            self.quantized[format] += 1
        return self._last[1]

    def summary(self) -> str:
        """One line: how many weights went into which format, and the seconds quantizing took."""
        counts = ", ".join(f"{count} in {format}" for format, count in self.quantized.most_common())
        dense = sum(1 for format in self._plan.values() if format is None)
        kept = f"; {dense} linear weights of in_features not a multiple of 32 stay dense" if dense else ""
        return f"in-situ quantization to {self.format}: {counts or 'no weights'}, {self.seconds:.1f} s{kept}"

    def tokenizer_files(self) -> dict:
        return self.dense.tokenizer_files()

    def release_pages(self) -> None:
        self._last = None
        self.dense.release_pages()

    def close(self) -> None:
        self._last = None
        self.dense.close()


def _check_dense(checkpoint: Checkpoint, format: str) -> None:
    """CheckpointError where the checkpoint is quantized already."""
    stored = None
    if isinstance(quantization := checkpoint.config.get("quantization_config"), dict):
        stored = quantization.get("quant_method", "its config.json's quantization_config")
    if stored is None:
        stored = next((found for name in checkpoint.tensor_names()
                       if (found := checkpoint.quantized_format(name)) is not None), None)
    if stored is not None:
        raise CheckpointError(checkpoint.path, f"is quantized already ({stored}); --isq {format.lower()} quantizes "
                                               "a dense checkpoint (safetensors, or a GGUF file of F32, F16 or "
                                               "BF16 tensors): drop --isq, or pass the dense checkpoint")


def quantization_plan(checkpoint: Checkpoint, format: str) -> dict[str, str | None]:
    """Each quantizable weight of `checkpoint` by name, and its format: `format`, FALLBACK_FORMAT, or
    None (it stays dense)."""
    from candelabra.core.loading.model_tensors import model_tensors
    from candelabra.core.models.config import ModelConfig
    from candelabra.plugins import installed_plugins

    config = ModelConfig.from_hf(checkpoint.config)
    family = installed_plugins().model_architectures.get(config.architecture)
    roles = {name: spec.role for name, spec in model_tensors(config, family).items()}
    names = set(checkpoint.tensor_names())
    if config.tie_word_embeddings or "lm_head.weight" not in names:
        roles["model.embed_tokens.weight"] = WeightRole.LM_HEAD
    plan = {}
    for name in names:
        if roles.get(name) in QUANTIZABLE_ROLES and not name.endswith(".gate.weight"):
            plan[name] = format_for(checkpoint.tensor_shape(name), format)
    return plan


def format_for(shape: tuple[int, ...], format: str) -> str | None:
    """The format a weight of `shape` takes when `format` is asked for (None: it stays dense)."""
    if len(shape) != 2:
        return None
    for candidate in (format, FALLBACK_FORMAT):
        if shape[1] % values_per_block(candidate) == 0:
            return candidate
    return None

