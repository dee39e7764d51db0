"""Qwen2 and Qwen2.5 (with QwQ and DeepSeek-R1-Distill-Qwen), and Qwen3.

Both are the shared decoder: Qwen2's query, key and value biases and Qwen3's per-head q/k
RMSNorms are picked up from the checkpoint's tensors."""

from candelabra.core.models.base import DecoderModel


class Qwen2(DecoderModel):
    pass


class Qwen3(DecoderModel):
    pass
