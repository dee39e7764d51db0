"""Registers the numpy backend through the `candelabra` entry-point group, like any plugin."""

from candelabra.plugins import hookimpl


@hookimpl
def register_backends(register):
    from candelabra.backends.cpu.backend import CpuBackend

    register(CpuBackend)
