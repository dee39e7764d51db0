"""The `candelabra` command: each subcommand is a module with `add_arguments(parser)` and `run(args)`,
imported only when it is the one asked for."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

# name: (module, help). Importing chat and bench (httpx, rich) or serve's server costs a quarter of a second
# and more, so no other command pays for it.
COMMANDS = {
    "backends": ("candelabra.core.commands.backends",
                 "list installed backends, whether they can run here and why not"),
    "conformance": ("candelabra.core.commands.conformance", "run the shared conformance suite on a backend"),
    "new-backend": ("candelabra.core.commands.new_backend",
                    "write a pip-installable backend package, for a PyTorch device extension or for a device "
                    "whose runtime hands out arrays of its own, which passes conformance as written"),
    "serve": ("candelabra.core.server.launch",
              "serve a model through the OpenAI API (default: Qwen2.5-Coder-0.5B-Instruct)"),
    "tune": ("candelabra.core.commands.tune",
             "measure a backend's kernels on this machine and write the table its serve then reads here"),
    "chat": ("candelabra.core.clients.chat", "chat in the terminal with a running server"),
    "bench": ("candelabra.core.clients.bench",
              "load a running server with concurrent streaming requests; throughput and latency"),
}


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
    for name, (module, help_text) in COMMANDS.items():
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


if __name__ == "__main__":
    sys.exit(main())
