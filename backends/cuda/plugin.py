"""Registers the cuda backend through the `candelabra` entry-point group, like any plugin."""

from candelabra.plugins import hookimpl


@hookimpl
def register_backends(register):
    from candelabra.backends.cuda.backend import CudaBackend

    register(CudaBackend)
