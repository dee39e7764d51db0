"""StableLM (StableLmForCausalLM): layer norms, partial rotary, optional qkv biases, and a
parallel residual when the config asks for one."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ConfigError


class StableLm(DecoderModel):
    norm_kind = "layer"

    def __init__(self, config, *args, **kwargs):
        if config.raw.get("qk_layernorm"):
            raise ConfigError("StableLM checkpoints with per-head q/k layer norms (qk_layernorm) are not supported")
        if config.raw.get("use_parallel_residual"):
            self.residual_layout = "parallel"
        super().__init__(config, *args, **kwargs)

    def layer_norm_names(self):
        return ("input_layernorm",) if self.residual_layout == "parallel" else super().layer_norm_names()
