"""The `candelabra` command."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys
from collections.abc import Sequence

from candelabra.core.text_table import format_table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(chosen=next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


def _parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The command line; only the `chosen` command's module is imported to add its arguments."""
    parser = argparse.ArgumentParser(prog="candelabra", description="LLM serving with pluggable hardware backends")
    parser.add_argument("--version", action="version", version=f"candelabra {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    backends = commands.add_parser("backends", help="list installed backends, whether they can run here and why not")
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends.add_argument("--kernels", action="store_true",
                          help="also print, for each backend that times its kernels, what it measured and chose here")
    backends.set_defaults(run=_backends)

    from candelabra.conformance import LEVELS, OPT_IN_LEVELS

    conformance = commands.add_parser("conformance", help="run the shared conformance suite on a backend")
    conformance.add_argument("--backend", required=True, help="a registered backend name, or package.module:Class")
    conformance.add_argument("--level", action="append", choices=LEVELS + OPT_IN_LEVELS,
                             help="suite level (default: ops, models and engine; parallel, which starts a process "
                                  "per rank, only when named)")
    conformance.add_argument("--op", action="append", default=[], help="only this op's cases (repeatable)")
    conformance.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    conformance.add_argument("--seed", type=int, help="base seed of the random inputs, to repeat a run")
    conformance.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                             help="compute dtype of the models and engine levels (default: float32); "
                                  "the ops level always runs every dtype the backend declares")
    conformance.add_argument("pytest_args", nargs="*", help="passed on to pytest after --, e.g. -- -x -v")
    conformance.set_defaults(run=_conformance)

    new_backend = commands.add_parser(
        "new-backend", help="write a pip-installable backend package for a PyTorch device extension, "
                            "which passes conformance on the CPU stand-in as written")
    new_backend.add_argument("name", metavar="NAME",
                             help="the backend's name, a lowercase Python identifier (e.g. acme); the package is "
                                  "candelabra-NAME")
    new_backend.add_argument("--torch-device", required=True, metavar="TYPE",
                             help="the device type the extension registers with torch (e.g. npu)")
    new_backend.add_argument("--extension", metavar="MODULE",
                             help="the module whose import registers it (default: torch_TYPE)")
    new_backend.add_argument("--visible-devices-variable", metavar="VARIABLE",
                             help="the environment variable that selects the visible devices "
                                  "(default: TYPE_VISIBLE_DEVICES, in upper case)")
    new_backend.add_argument("--distributed-backend", default="gloo", metavar="NAME",
                             help="the torch.distributed name of the collective library (default: gloo)")
    new_backend.add_argument("--dir", default=".",
                             help="the folder to write candelabra-NAME/ in (default: the current directory)")
    new_backend.set_defaults(run=_new_backend)

    for name, (module, help_text) in MODULE_COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            command_module = importlib.import_module(module)
            command_module.add_arguments(command)
            command.set_defaults(run=command_module.run)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("candelabra")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


# Commands whose module brings its own arguments (`add_arguments`) and entry (`run`). Importing
# chat and bench (httpx, rich) costs a quarter of a second, so no other command pays for it.
MODULE_COMMANDS = {
    "serve": ("candelabra.core.server.launch",
              "serve a model through the OpenAI API (default: Qwen2.5-Coder-0.5B-Instruct)"),
    "chat": ("candelabra.core.clients.chat", "chat in the terminal with a running server"),
    "bench": ("candelabra.core.clients.bench",
              "load a running server with concurrent streaming requests; throughput and latency"),
}


def _backends(args: argparse.Namespace) -> int:
    from candelabra.plugins import installed_plugins, ranked_backends

    plugins = installed_plugins()
    ranked = ranked_backends(plugins)
    auto = ranked[0].name if ranked and ranked[0].probe.available else None
    rows = [{
        "name": c.name,
        "distribution": c.distribution,
        "available": c.probe.available,
        "priority": c.probe.priority,
        "detail": c.probe.device if c.probe.available else c.probe.reason,
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
            text = "no kernel choices measured on this machine yet (the first model load measures them)"
        else:
            text = "picks no kernels by timing"
        print(f"\n{candidate.name}: {text}")


def _times_kernels(backend_class) -> bool:
    from candelabra.core.contract.backend import Backend

    return backend_class.kernel_tables.__func__ is not Backend.kernel_tables.__func__


def _conformance(args: argparse.Namespace) -> int:
    from candelabra.conformance import LEVELS
    from candelabra.conformance.runner import run

    return run(args.backend, levels=args.level or LEVELS, ops=args.op, json_path=args.json, seed=args.seed,
               dtype=args.dtype, pytest_args=args.pytest_args)


def _new_backend(args: argparse.Namespace) -> int:
    from candelabra.core.new_backend import BackendSpec, NewBackendError, write_package

    spec = BackendSpec.with_defaults(args.name, args.torch_device, args.extension, args.visible_devices_variable,
                                     args.distributed_backend)
    try:
        folder = write_package(spec, args.dir)
    except NewBackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {folder}: the {spec.name} backend on {spec.device_type} through {spec.extension}. Next:\n"
          f"    cd {folder}\n"
          f"    pip install -e .\n"
          f"    CANDELABRA_STAND_IN={spec.device_type} candelabra conformance --backend {spec.name}\n"
          f"README.md says more.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
