"""The files `candelabra new-backend` writes, as `string.Template` texts keyed by their path in the
package folder. The placeholders: $name (the backend), $distribution, $package, $class_name,
$device_type, $extension, $visible_devices_variable, $distributed_backend and $candelabra_requirement.

Python files import the package's own modules relatively, and never torch next to candelabra, so that
their imports sort the same under any isort settings that know one of the two as first-party.
"""

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "The $name backend for candelabra: torch on $device_type devices through $extension"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "$candelabra_requirement",
    # The torch that $extension is built against; $extension itself comes with the vendor's software.
    "torch>=2.5",
]

# How candelabra finds the backend: `candelabra backends` lists it once the package is installed.
[project.entry-points.candelabra]
$name = "$package.plugin"

[tool.setuptools]
packages = ["$package"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

README = """\
# $distribution

The `$name` backend for candelabra: candelabra's torch backend on the `$device_type` device that
`$extension` registers with PyTorch, with vendor kernels in place of torch ops where
`$package/overrides.py` lists them. Everything else (memory, the paged KV cache, every other op,
the models) is candelabra's.

## Install

In the environment that has candelabra, torch and `$extension`:

    pip install -e .

`candelabra backends` then lists `$name`, or says why it cannot run here.

## Check

Without the hardware, torch's CPU device stands in for `$device_type`, with the kernels taken from
`$package/stand_in.py`:

    CANDELABRA_STAND_IN=$device_type candelabra conformance --backend $name

On the hardware, run the same without `CANDELABRA_STAND_IN`. The table's `kernel` column says, per
op, whether your kernel ran (`override`) or the torch op did (`fell back`). `pytest` runs the ops
level on the stand-in and checks that every kernel in `overrides.py` ran (`tests/test_conformance.py`).

## Serve

    candelabra serve --backend $name --weight-path /path/to/checkpoint

With `CANDELABRA_STAND_IN=$device_type` in front, the same serves on the CPU stand-in.

## Adding a kernel

1. Add the op to `OVERRIDES` in `$package/overrides.py`; the comments there say how.
2. Add a stand-in for the kernel to `$package/stand_in.py`: the same name and arguments, in plain torch.
3. Run the check above: the op's `kernel` column says `override`.

`docs/writing-a-backend.md` in candelabra's repository explains the override table, fall-backs,
dtypes and the stand-in in full.
"""

INIT = '''\
"""The $name backend for candelabra: torch on $device_type devices through $extension.

backend.py    the backend: device type, extension, dtypes, and which kernels replace torch ops
overrides.py  the vendor kernels, op by op
stand_in.py   plain-torch stand-ins for those kernels, for CANDELABRA_STAND_IN=$device_type
plugin.py     registers the backend with candelabra (the `candelabra` entry point in pyproject.toml)
"""
'''

PLUGIN = '''\
"""Registers the $name backend with candelabra, through the `candelabra` entry point in pyproject.toml."""

from candelabra.plugins import hookimpl

from .backend import $class_name


@hookimpl
def register_backends(register):
    register($class_name)
'''

BACKEND = '''\
"""The $name backend: candelabra's torch backend on the $device_type device that $extension registers,
with the vendor kernels that overrides.py lists in place of torch ops.

Without the hardware, `CANDELABRA_STAND_IN=$device_type` runs it unchanged on torch's CPU device,
the kernels then taken from $package.stand_in.
"""

from __future__ import annotations

from candelabra.backends.torch.accelerator import AcceleratorBackend

from .overrides import KERNELS, OVERRIDES


class $class_name(AcceleratorBackend):
    name = "$name"
    device_type = "$device_type"
    extension = "$extension"  # importing it registers the device type with torch
    visible_devices_variable = "$visible_devices_variable"  # named when a probe finds no device
    distributed_backend = "$distributed_backend"  # the collective library's torch.distributed name
    device_dtypes = ("bfloat16", "float16", "float32")  # what the device computes in, the default first
    overrides = OVERRIDES
    stand_in_modules = {KERNELS: "$package.stand_in"}
'''

OVERRIDES = '''\
"""The vendor kernels that replace torch ops on $device_type: op name -> VendorKernel.

A kernel that cannot be found when the backend is built falls back to the torch op, with the reason
logged; one that declines a call (returns NotImplemented) lets the torch op run that call.
`candelabra conformance` says in its `kernel` column which ran.
"""

from __future__ import annotations

from collections.abc import Callable

from candelabra.backends.torch.accelerator import VendorKernel

# Where $extension registers its kernels with torch: TORCH_LIBRARY($device_type, m) in C++ makes them
# torch.ops.$device_type.NAME. Change it to the namespace the extension uses. On the CPU stand-in,
# $package.stand_in takes its place (stand_in_modules in backend.py).
KERNELS = "torch.ops.$device_type"


def silu_and_mul_into_output(kernel: Callable) -> Callable:
    """The kernel silu_and_mul(out [..., I], x [..., 2I]), which writes into `out`, as the op
    silu_and_mul(x), which returns the result."""

    def silu_and_mul(x):
        out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
        kernel(out, x.contiguous())
        return out

    return silu_and_mul


# To add a kernel, add an entry:
# - the key is the op's name in candelabra.core.contract.ops (OP_NAMES); the class refuses any other.
# - the target is "module:attribute", or f"{KERNELS}:name" for a kernel the extension registers.
# - `adapt` turns the kernel into the op where their calling conventions differ; leave it out when
#   the kernel takes the op's arguments and returns its result. An adapter may return NotImplemented
#   for arguments the kernel does not take (a dtype, a weight offset), and the torch op runs instead.
# - `requires="module"` imports that module first, where it, not $extension, registers the kernel;
#   map it to the stand-in in backend.py's stand_in_modules too, or the stand-in falls back to torch.
# - `required=True` makes a kernel that cannot be found an error when the backend is built, instead
#   of a logged fall-back to the torch op: for a kernel the device cannot do without.
# Then give the kernel a stand-in of the same name and arguments in stand_in.py.
OVERRIDES = {
    "silu_and_mul": VendorKernel(f"{KERNELS}:silu_and_mul", adapt=silu_and_mul_into_output),
}
'''

STAND_IN = '''\
"""Stands in for $extension's kernels on the CPU stand-in (CANDELABRA_STAND_IN=$device_type): each takes
the same arguments as the kernel it stands in for and computes the same in plain torch, so that the
override table and its adapters run in tests as they do on the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.float().chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)
'''

TEST_CONFORMANCE = '''\
"""candelabra's conformance suite, ops level, on the CPU stand-in: every op passes, and every kernel
in overrides.py runs rather than falling back to torch."""

import json
import os
import subprocess
import sys

from $package.backend import $class_name


def test_ops_conformance_passes_on_the_stand_in_and_every_override_runs(tmp_path):
    report = tmp_path / "conformance.json"
    command = [sys.executable, "-m", "candelabra.core.cli", "conformance", "--backend", $class_name.name,
               "--level", "ops", "--json", str(report)]
    stand_in = {**os.environ, "CANDELABRA_STAND_IN": $class_name.device_type}
    run = subprocess.run(command, capture_output=True, text=True, env=stand_in, timeout=1800)
    assert run.returncode == 0, run.stdout[-10000:] + run.stderr[-10000:]
    summary = json.loads(report.read_text())["summary"]
    for op in $class_name.overrides:
        assert summary[op]["kernels"].get("override"), f"{op}: the override never ran ({summary[op]['kernels']})"
'''

FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "$package/__init__.py": INIT,
    "$package/plugin.py": PLUGIN,
    "$package/backend.py": BACKEND,
    "$package/overrides.py": OVERRIDES,
    "$package/stand_in.py": STAND_IN,
    "tests/test_conformance.py": TEST_CONFORMANCE,
}
