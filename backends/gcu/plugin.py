"""Registers the gcu backend through the `candelabra` entry-point group, like any plugin."""

from candelabra.plugins import hookimpl


@hookimpl
def register_backends(register):
    from candelabra.backends.gcu.backend import GcuBackend

    register(GcuBackend)
