"""Phi-3 and Phi-2.

Phi-3 is the shared decoder with fused qkv and gate_up projections (read as they are) and
longrope scaling (from the config). Phi-2 runs attention and MLP side by side from one layer
norm, rotates part of each head, and uses an ungated tanh-GELU MLP with biases everywhere."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.blocks import ParallelBlock


class Phi3(DecoderModel):
    pass


class Phi2(DecoderModel):
    norm_kind = "layer"
    block = ParallelBlock(norm="input_layernorm")
    gated_mlp = False
    attention_out_name = "dense"
    final_norm_name = "model.final_layernorm"
