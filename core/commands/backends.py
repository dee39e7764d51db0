"""`candelabra backends`: the installed backends, whether each can run here and why not, which one
`--backend auto` picks, broken plugins and name conflicts; with --kernels, the kernel tables each
backend reads here."""

from __future__ import annotations

import argparse
import json
import sys

from candelabra.core.text_table import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--kernels", action="store_true",
                        help="also print, for each backend that picks its kernels by a table, the rows it reads here")


def run(args: argparse.Namespace) -> int:
    from candelabra.plugins import installed_plugins, ranked_backends

    plugins = installed_plugins()
    ranked = ranked_backends(plugins)
    auto = ranked[0].name if ranked and ranked[0].probe.available else None
    rows = [{
        "name": c.name,
        "distribution": c.distribution,
        "available": c.probe.available,
        "priority": c.probe.priority,
        "detail": c.probe.detail if c.probe.available else c.probe.reason,
    } for c in ranked]
    broken = [{"plugin": b.source.plugin, "distribution": b.source.distribution, "stage": b.stage, "error": b.error}
              for b in plugins.broken]
    conflicts = {name: [r.source.distribution for r in regs] for name, regs in plugins.backends.conflicts().items()}
    if args.json:
        print(json.dumps({"backends": rows, "auto": auto, "broken_plugins": broken, "conflicts": conflicts}, indent=2))
    else:
        print(format_table(
            ("backend", "distribution", "available", "priority", "auto", "device / why not"),
            [(r["name"], r["distribution"], "yes" if r["available"] else "no",
              str(r["priority"]) if r["available"] else "-", "picks" if r["name"] == auto else "", r["detail"])
             for r in rows],
        ))
        for b in broken:
            print(f"broken plugin {b['plugin']!r} from {b['distribution']} ({b['stage']}): {b['error']}")
    if args.kernels:
        _print_kernel_tables(ranked)
    for name, distributions in conflicts.items():
        print(f"error: backend name {name!r} is claimed by {' and '.join(distributions)}; uninstall one of them",
              file=sys.stderr)
    return 1 if conflicts else 0


def _print_kernel_tables(ranked) -> None:
    for candidate in ranked:
        if not candidate.probe.available:
            continue
        tables = candidate.backend.kernel_tables()
        if tables:
            text = "\n\n".join(tables)
        elif _times_kernels(candidate.backend):
            text = "no kernel table for this machine"
        else:
            text = "picks no kernels by a table"
        print(f"\n{candidate.name}: {text}")


def _times_kernels(backend_class) -> bool:
    from candelabra.core.contract.backend import Backend

    return backend_class.kernel_tables.__func__ is not Backend.kernel_tables.__func__
