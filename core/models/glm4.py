"""GLM-4 (Glm4ForCausalLM): norms after attention and after the MLP as well as before them,
interleaved (GPT-J style) rotary on half of each head, fused gate_up."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.blocks import SandwichBlock


class Glm4(DecoderModel):
    rotary_style = "gptj"
    block = SandwichBlock(before_attention="input_layernorm", after_attention="post_self_attn_layernorm",
                          before_mlp="post_attention_layernorm", after_mlp="post_mlp_layernorm")
