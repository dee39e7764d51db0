"""Qwen2 and Qwen2.5 (with QwQ and DeepSeek-R1-Distill-Qwen), Qwen3, and Qwen3-MoE.

All are the shared decoder: Qwen2's query, key and value biases and Qwen3's per-head q/k
RMSNorms are picked up from the checkpoint's tensors. Qwen3-MoE is Qwen3 with a sparse
mixture-of-experts MLP in the layers its config.json makes sparse (`MoeConfig`)."""

from candelabra.core.models.base import DecoderModel


class Qwen2(DecoderModel):
    pass


class Qwen3(DecoderModel):
    pass


class Qwen3Moe(DecoderModel):
    pass
