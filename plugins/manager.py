"""Finding plugins through entry points and collecting what they register.

pluggy's own `load_setuptools_entrypoints` stops at the first plugin that fails to import. Here
every entry point is loaded on its own, and a plugin that fails to import, or raises inside a
hook, is kept aside as broken with its error while the others load.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import pluggy

from candelabra.plugins import hookspecs
from candelabra.plugins.registry import PluginSource, Registration, Registry, RegistryError

ENTRY_POINT_GROUP = "candelabra"


@dataclass(frozen=True)
class BrokenPlugin:
    source: PluginSource
    stage: str  # "import" or the name of the hook that raised
    error: str


@dataclass
class Plugins:
    """Everything discovered: the plugin manager, the broken plugins and one registry per hook."""

    manager: pluggy.PluginManager
    sources: dict[str, PluginSource] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    backends: Registry = field(default_factory=lambda: Registry("backend"))
    model_architectures: Registry = field(default_factory=lambda: Registry("model architecture"))
    quantization_formats: Registry = field(default_factory=lambda: Registry("quantization format"))


def discover(group: str = ENTRY_POINT_GROUP) -> Plugins:
    """Load every plugin of the entry-point `group` and run their registration hooks."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    plugins = Plugins(manager)
    for entry_point in sorted(importlib.metadata.entry_points(group=group), key=lambda ep: ep.name):
        source = PluginSource(entry_point.name, _distribution_label(entry_point))
        try:
            module = entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any import failure marks the plugin broken
            plugins.broken.append(BrokenPlugin(source, "import", _one_line(exc)))
            continue
        _register(plugins, entry_point.name, module, source)
    _collect(plugins, "register_backends", plugins.backends, _backend_registration)
    _collect(plugins, "register_model_architectures", plugins.model_architectures, _named_registration)
    _collect(plugins, "register_quantization_formats", plugins.quantization_formats, _named_registration)
    return plugins


@functools.cache
def installed_plugins() -> Plugins:
    """The plugins installed in this environment, discovered once per process."""
    return discover()


def backend_class(spec: str, plugins: Plugins | None = None) -> type:
    """The backend class for `spec`: a registered backend name, or "package.module:ClassName"
    for a backend not installed as a plugin (handy while writing one)."""
    if ":" not in spec:
        return (plugins or installed_plugins()).backends.get(spec)
    from candelabra.core.contract.backend import Backend

    module_name, _, class_name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"cannot load backend {spec!r}: {_one_line(exc)}") from exc
    if not (isinstance(found, type) and issubclass(found, Backend)):
        raise RegistryError(f"{spec!r} is not a Backend subclass")
    return found


def _register(plugins: Plugins, name: str, module: ModuleType, source: PluginSource) -> None:
    try:
        plugins.manager.register(module, name=name)
    except Exception as exc:  # noqa: BLE001 - e.g. a hook implementation pluggy rejects
        plugins.broken.append(BrokenPlugin(source, "import", _one_line(exc)))
        return
    plugins.sources[name] = source


def _collect(
    plugins: Plugins,
    hook_name: str,
    registry: Registry,
    make: Callable[[tuple, PluginSource], Registration],
) -> None:
    """Call each plugin's implementation of `hook_name` separately, so that registrations are
    attributed to their plugin and one plugin's failure drops only its own."""
    for impl in getattr(plugins.manager.hook, hook_name).get_hookimpls():
        source = plugins.sources[impl.plugin_name]
        pending: list[Registration] = []
        try:
            register = functools.partial(_register_into, pending, make, source)
            impl.function(*([register] if impl.argnames else []))
        except Exception as exc:  # noqa: BLE001 - a plugin's failure must not stop the others
            plugins.broken.append(BrokenPlugin(source, hook_name, _one_line(exc)))
            continue
        for registration in pending:
            registry.add(registration)


def _register_into(pending: list, make: Callable, source: PluginSource, *args) -> None:
    pending.append(make(args, source))


def _backend_registration(args: tuple, source: PluginSource) -> Registration:
    from candelabra.core.contract.backend import Backend

    (backend_class,) = args
    if not (isinstance(backend_class, type) and issubclass(backend_class, Backend)):
        raise TypeError(f"register_backends got {backend_class!r}, which is not a Backend subclass")
    if not backend_class.name:
        raise TypeError(f"backend class {backend_class.__qualname__} has no name")
    return Registration(backend_class.name, backend_class, source)


def _named_registration(args: tuple, source: PluginSource) -> Registration:
    name, value = args
    if not isinstance(name, str) or not name:
        raise TypeError(f"a registration needs a non-empty name, got {name!r}")
    return Registration(name, value, source)


def _distribution_label(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"{dist.name} {dist.version}" if dist is not None else "(unknown distribution)"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
