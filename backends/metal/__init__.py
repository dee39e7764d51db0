"""The MLX backend: Apple GPUs through Metal, or MLX's CPU build elsewhere."""

from candelabra.backends.metal.backend import MetalBackend

__all__ = ["MetalBackend"]
