"""The numpy reference backend."""

from candelabra.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
