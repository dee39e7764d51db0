"""`candelabra new-backend`: a pip-installable backend package that passes conformance as written, for
a PyTorch device extension (`--torch-device`, on the CPU stand-in) or for a device whose runtime hands
out arrays of its own (`--array-library`, numpy standing in for it). The package itself: `backend_package`."""

from __future__ import annotations

import argparse
import sys

from candelabra.core.commands.backend_package import (
    ARRAY_LIBRARIES,
    ArrayLibrarySpec,
    NewBackendError,
    PackageSpec,
    TorchDeviceSpec,
    write_package,
)

_TORCH_ONLY = {"extension": "--extension", "visible_devices_variable": "--visible-devices-variable",
               "distributed_backend": "--distributed-backend"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME",
                        help="the backend's name, a lowercase Python identifier (e.g. acme); the package is "
                             "candelabra-NAME")
    kind = parser.add_argument_group("what the backend runs on (one of the two)")
    kind.add_argument("--torch-device", metavar="TYPE",
                      help="a PyTorch device extension: the device type it registers with torch (e.g. npu)")
    kind.add_argument("--array-library", metavar="LIBRARY",
                      help="a device whose runtime hands out arrays of its own (not a torch device): the "
                           f"array library the package is written on, to start from ({', '.join(ARRAY_LIBRARIES)})")
    torch = parser.add_argument_group("with --torch-device")
    torch.add_argument("--extension", metavar="MODULE",
                       help="the module whose import registers the device type (default: torch_TYPE)")
    torch.add_argument("--visible-devices-variable", metavar="VARIABLE",
                       help="the environment variable that selects the visible devices "
                            "(default: TYPE_VISIBLE_DEVICES, in upper case)")
    torch.add_argument("--distributed-backend", metavar="NAME",
                       help="the torch.distributed name of the collective library (default: gloo)")
    parser.add_argument("--dir", default=".",
                        help="the folder to write candelabra-NAME/ in (default: the current directory)")


def run(args: argparse.Namespace) -> int:
    try:
        spec = _spec(args)
        folder = write_package(spec, args.dir)
    except NewBackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(_next_steps(spec, folder))
    return 0


def _spec(args: argparse.Namespace) -> PackageSpec:
    """The spec the arguments describe; NewBackendError unless they name exactly one kind of backend."""
    if args.torch_device is not None and args.array_library is not None:
        raise NewBackendError("--torch-device and --array-library are two kinds of backend; give one: "
                              "--torch-device TYPE for a device with a PyTorch extension, --array-library "
                              "for a device whose runtime hands out arrays of its own")
    if args.torch_device is not None:
        return TorchDeviceSpec.with_defaults(args.name, args.torch_device, args.extension,
                                             args.visible_devices_variable, args.distributed_backend)
    if args.array_library is None:
        raise NewBackendError("say what the backend runs on: --torch-device TYPE for a device with a PyTorch "
                              "extension (the device type it registers, e.g. npu), or --array-library "
                              f"{'|'.join(ARRAY_LIBRARIES)} for a device whose runtime hands out arrays of its own; "
                              "docs/writing-a-backend.md, 'Which scaffold', says more")
    given = [flag for option, flag in _TORCH_ONLY.items() if getattr(args, option) is not None]
    if given:
        raise NewBackendError(f"{', '.join(given)} belong to --torch-device backends; an --array-library backend "
                              f"has no torch extension")
    return ArrayLibrarySpec(args.name, args.array_library)


def _next_steps(spec: PackageSpec, folder) -> str:
    if isinstance(spec, TorchDeviceSpec):
        return (f"wrote {folder}: the {spec.name} backend on {spec.device_type} through {spec.extension}. Next:\n"
                f"    cd {folder}\n"
                f"    pip install -e .\n"
                f"    CANDELABRA_STAND_IN={spec.device_type} candelabra conformance --backend {spec.name}\n"
                f"README.md says more.")
    return (f"wrote {folder}: the {spec.name} backend on {spec.array_library} arrays, the host standing in for "
            f"the device. Next:\n"
            f"    cd {folder}\n"
            f"    pip install -e .\n"
            f"    candelabra conformance --backend {spec.name} --level ops\n"
            f"README.md says which methods to replace with your runtime's calls, in order.")
