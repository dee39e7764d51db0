"""Named things that plugins provide, each remembered with the plugin that provided it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin came from: its entry point name and its distribution ("name version")."""

    plugin: str
    distribution: str


@dataclass(frozen=True)
class Registration(Generic[T]):
    name: str
    value: T
    source: PluginSource


class RegistryError(LookupError):
    """A name that nothing provides, or that two plugins provide."""


class Registry(Generic[T]):
    """Registrations of one kind ("backend", "model architecture", ...), by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._by_name: dict[str, list[Registration[T]]] = {}

    def add(self, registration: Registration[T]) -> None:
        self._by_name.setdefault(registration.name, []).append(registration)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def registrations(self) -> list[Registration[T]]:
        return [r for name in self.names() for r in self._by_name[name]]

    def conflicts(self) -> dict[str, list[Registration[T]]]:
        """Names claimed by more than one plugin."""
        return {name: regs for name, regs in sorted(self._by_name.items()) if len(regs) > 1}

    def lookup(self, name: str) -> Registration[T]:
        regs = self._by_name.get(name)
        if not regs:
            known = ", ".join(self.names()) or "none"
            raise RegistryError(f"no {self.kind} named {name!r} is installed (installed: {known})")
        if len(regs) > 1:
            claimants = " and ".join(f"{r.source.distribution} (plugin {r.source.plugin!r})" for r in regs)
            raise RegistryError(
                f"{self.kind} name {name!r} is claimed by {claimants}; uninstall one of them"
            )
        return regs[0]

    def get(self, name: str) -> T:
        return self.lookup(name).value

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


