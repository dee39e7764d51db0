"""StableLM (StableLmForCausalLM): layer norms, partial rotary, optional qkv biases, and a
parallel residual when the config asks for one."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.blocks import Block, ParallelBlock
from candelabra.core.models.config import ConfigError, ModelConfig


class StableLm(DecoderModel):
    norm_kind = "layer"

    @classmethod
    def block_for(cls, config: ModelConfig) -> Block:
        if config.raw.get("qk_layernorm"):
            raise ConfigError("StableLM checkpoints with per-head q/k layer norms (qk_layernorm) are not supported")
        return ParallelBlock(norm="input_layernorm") if config.raw.get("use_parallel_residual") else cls.block
