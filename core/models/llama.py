"""Llama 2, 3 and 3.1, and the checkpoints built on its graph: Mistral, Yi,
DeepSeek-R1-Distill-Llama. The shared decoder is exactly this family."""

from candelabra.core.models.base import DecoderModel


class Llama(DecoderModel):
    pass
