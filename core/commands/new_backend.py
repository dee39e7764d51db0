"""`candelabra new-backend`: a pip-installable backend package for a PyTorch device extension, which
passes conformance on the CPU stand-in as written (the package itself: `backend_package`)."""

from __future__ import annotations

import argparse
import sys

from candelabra.core.commands.backend_package import BackendSpec, NewBackendError, write_package


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME",
                        help="the backend's name, a lowercase Python identifier (e.g. acme); the package is "
                             "candelabra-NAME")
    parser.add_argument("--torch-device", required=True, metavar="TYPE",
                        help="the device type the extension registers with torch (e.g. npu)")
    parser.add_argument("--extension", metavar="MODULE",
                        help="the module whose import registers it (default: torch_TYPE)")
    parser.add_argument("--visible-devices-variable", metavar="VARIABLE",
                        help="the environment variable that selects the visible devices "
                             "(default: TYPE_VISIBLE_DEVICES, in upper case)")
    parser.add_argument("--distributed-backend", default="gloo", metavar="NAME",
                        help="the torch.distributed name of the collective library (default: gloo)")
    parser.add_argument("--dir", default=".",
                        help="the folder to write candelabra-NAME/ in (default: the current directory)")


def run(args: argparse.Namespace) -> int:
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
