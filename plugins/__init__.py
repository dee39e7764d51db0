"""The plugin system: hooks, discovery through entry points, and the registries they fill."""

from candelabra.plugins.hookspecs import hookimpl
from candelabra.plugins.manager import BrokenPlugin, Plugins, backend_class, discover, installed_plugins
from candelabra.plugins.ranking import Candidate, auto_choice, choose_backend, ranked_backends
from candelabra.plugins.registry import PluginSource, Registration, Registry, RegistryError

__all__ = [
    "BrokenPlugin",
    "Candidate",
    "PluginSource",
    "Plugins",
    "Registration",
    "Registry",
    "RegistryError",
    "auto_choice",
    "backend_class",
    "choose_backend",
    "discover",
    "hookimpl",
    "installed_plugins",
    "ranked_backends",
]
