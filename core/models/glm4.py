"""GLM-4 (Glm4ForCausalLM): norms after attention and after the MLP as well as before them,
interleaved (GPT-J style) rotary on half of each head, fused gate_up."""

from candelabra.core.models.base import DecoderModel


class Glm4(DecoderModel):
    rotary_style = "gptj"
    residual_layout = "sandwich"

    def layer_norm_names(self):
        return ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")

    def sandwich_norm_names(self):
        return ("post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")
