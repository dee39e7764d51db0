"""How `--backend auto` chooses: every installed backend asked by its probe, ranked by priority."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from candelabra.core.contract.backend import Probe
from candelabra.plugins.manager import Plugins, _one_line, backend_class, installed_plugins
from candelabra.plugins.registry import RegistryError

log = logging.getLogger("candelabra")


@dataclass(frozen=True)
class Candidate:
    """An installed backend name, where it comes from, its class (None when two plugins claim the
    name) and its probe."""

    name: str
    distribution: str
    backend: type | None
    probe: Probe


def ranked_backends(plugins: Plugins | None = None) -> list[Candidate]:
    """Every installed backend, best first: the available ones by priority, higher first (equal
    priorities in name order), then the unavailable ones by name. A name that two plugins claim,
    or whose probe raises, is unavailable, with that as its reason."""
    registry = (plugins or installed_plugins()).backends
    found = []
    for name in registry.names():
        try:
            registration = registry.lookup(name)
        except RegistryError as exc:
            claimants = " and ".join(r.source.distribution for r in registry.conflicts()[name])
            found.append(Candidate(name, claimants, None, Probe(False, str(exc))))
            continue
        found.append(Candidate(name, registration.source.distribution, registration.value,
                               _probe(registration.value)))
    return sorted(found, key=lambda c: (not c.probe.available, -c.probe.priority if c.probe.available else 0, c.name))


def auto_choice(ranked: list[Candidate]) -> Candidate:
    """The backend `--backend auto` takes from `ranked_backends()`; RuntimeError when none is available."""
    if not ranked or not ranked[0].probe.available:
        reasons = "; ".join(f"{c.name}: {c.probe.reason}" for c in ranked) or "none is installed"
        raise RuntimeError(f"no backend is available: {reasons}")
    return ranked[0]


def _probe(backend: type) -> Probe:
    try:
        return backend.probe()
    except Exception as exc:  # noqa: BLE001 - a probe must not raise; one that does only rules itself out
        return Probe(False, f"its probe raised {_one_line(exc)}")


def choose_backend(name: str = "auto"):
    """The backend class for `name`; "auto" picks the available one of highest priority, saying
    which and what it passed over."""
    if name != "auto":
        cls = backend_class(name)
        probe = cls.probe()
        if not probe.available:
            raise RuntimeError(f"backend {name!r} is not available: {probe.reason}")
        return cls
    ranked = ranked_backends()
    chosen = auto_choice(ranked)
    passed_over = [f"{c.name}: priority {c.probe.priority}, on {c.probe.detail}" if c.probe.available else
                   f"{c.name}: not available, {c.probe.reason}" for c in ranked if c is not chosen]
    log.info("backend auto: chose %s, priority %d, the highest available, on %s (passed over: %s)", chosen.name,
             chosen.probe.priority, chosen.probe.detail, "; ".join(passed_over) or "none")
    return chosen.backend
