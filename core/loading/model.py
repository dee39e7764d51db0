"""A checkpoint's model on a backend: its family from config.json, its weights through the loader."""

from __future__ import annotations

import logging

from candelabra.core.contract.backend import Backend
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.ops import OpNotSupported
from candelabra.core.loading.decoder_weights import load_decoder_weights
from candelabra.core.loading.in_situ import InSituQuantized
from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.offloaded_experts import ExpertOffload, describe_offload
from candelabra.core.weights import Checkpoint

log = logging.getLogger("candelabra")


def load_model(checkpoint: Checkpoint, backend: Backend, dtype: str | None = None, model_type: str | None = None,
               progress: bool = False, communicator: Communicator | None = None,
               lm_head_layout: str | None = None, expert_offload: ExpertOffload | None = None) -> DecoderModel:
    """The checkpoint's model on `backend`, computing in `dtype` (the backend's first by default).
    `model_type` is one of candle-vllm's words (llama3, qwen2, ...), checked against the checkpoint.

    With a `communicator` of more than one rank, this rank's shard of the tensor-parallel model
    (see `DecoderModel`; `lm_head_layout` one of `sharding.LM_HEAD_LAYOUTS`, else the model's
    default); every rank of the group loads it with the same arguments.

    With `expert_offload`, some of each MoE layer's experts live in host memory (see
    `offloaded_experts`): ConfigError for a dense model or too few experts, NotImplementedError on a
    backend that cannot copy experts in; on one whose tensors are in host memory anyway it is logged
    as changing nothing.

    OpNotSupported, before any weight is read, when the model needs an op the backend lacks (the
    experts of a mixture-of-experts model)."""
    from candelabra.plugins import RegistryError, installed_plugins

    config = ModelConfig.from_hf(checkpoint.config)
    if model_type:
        config.check_model_type(model_type)
    architectures = installed_plugins().model_architectures
    try:
        family = architectures.get(config.architecture)
    except RegistryError as exc:
        raise ConfigError(f"{checkpoint.path}: {exc}") from exc
    missing = [op for op in family.ops_needed(config) if not backend.ops.supports(op)]
    if missing:
        raise OpNotSupported(backend.name, missing[0], f"a {config.architecture} needs {' and '.join(missing)}, "
                                                       "which this backend does not implement; choose another")
    if expert_offload is not None:
        expert_offload.check_model(config)
        expert_offload = expert_offload.on(backend)
    weights = load_decoder_weights(family, config, backend, checkpoint, dtype or backend.dtypes[0], communicator,
                                   lm_head_layout, progress, expert_offload)
    if expert_offload is not None:
        log.info("experts: %s; each MoE layer reads its routing on the host, so steps run op by op",
                 describe_offload(weights.layers))
    if isinstance(checkpoint, InSituQuantized):
        log.info("%s", checkpoint.summary())
    return family(config, backend, weights, communicator)
