"""Gemma, Gemma 2 and Gemma 3 (text).

Gemma stores RMSNorm weights as w - 1, scales embeddings by sqrt(hidden_size) and uses tanh GELU.
Gemma 2 adds norms after attention and after the MLP, soft-caps attention and final logits, and
alternates sliding-window and global layers. Gemma 3 drops the soft-capping for q/k norms and
gives its sliding-window layers their own rope base; all of that comes from the config."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.blocks import SandwichBlock


class Gemma(DecoderModel):
    norm_offset = 1.0
    scale_embeddings = True


class Gemma2(Gemma):
    block = SandwichBlock(before_attention="input_layernorm", after_attention="post_attention_layernorm",
                          before_mlp="pre_feedforward_layernorm", after_mlp="post_feedforward_layernorm")


class Gemma3(Gemma2):
    pass
