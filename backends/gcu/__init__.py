"""The Enflame GCU backend through its PyTorch extension, torch_gcu, and the template for every other
PyTorch device extension: see docs/writing-a-backend.md."""

from candelabra.backends.gcu.backend import GcuBackend

__all__ = ["GcuBackend"]
