"""Model architectures, one file per family on the shared decoder in `base`."""

from __future__ import annotations

from candelabra.core.contract.backend import Backend
from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.weights import Checkpoint


def load_model(checkpoint: Checkpoint, backend: Backend, dtype: str | None = None, model_type: str | None = None,
               progress: bool = False) -> DecoderModel:
    """The checkpoint's model on `backend`, computing in `dtype` (the backend's first by default).
    `model_type` is one of candle-vllm's words (llama3, qwen2, ...), checked against the checkpoint."""
    from candelabra.plugins import RegistryError, installed_plugins

    config = ModelConfig.from_hf(checkpoint.config)
    if model_type:
        config.check_model_type(model_type)
    architectures = installed_plugins().model_architectures
    try:
        model_class = architectures.get(config.architecture)
    except RegistryError as exc:
        raise ConfigError(f"{checkpoint.path}: {exc}") from exc
    return model_class(config, backend, checkpoint, dtype or backend.dtypes[0], progress=progress)


__all__ = ["DecoderModel", "load_model"]
