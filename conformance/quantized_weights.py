"""Random weights in every quantized GGUF format, for the quantized `linear` cases: the core's
generator (dummy checkpoints use it too), under the name the suite has always imported."""

from candelabra.core.weights.random_quantized import FLOAT16_FIELDS, random_quantized

__all__ = ["FLOAT16_FIELDS", "random_quantized"]
