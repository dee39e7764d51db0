"""`candelabra new-backend`: writes a pip-installable backend package of one of two kinds, which passes
conformance as written:

- `TorchDeviceSpec`: for a PyTorch device extension, built on
  `candelabra.backends.torch.accelerator.AcceleratorBackend`, run on the CPU stand-in;
- `ArrayLibrarySpec`: for a device whose runtime hands out arrays of its own, the whole contract written
  on an array library's arrays (numpy: the host plays the device), each op running the numpy reference
  until the vendor gives it a kernel.

The file texts are in `backend_package_templates` and `array_backend_templates`.
"""

from __future__ import annotations

import importlib.metadata
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import ClassVar

from candelabra.core.commands import array_backend_templates, backend_package_templates
from candelabra.plugins import installed_plugins

_LOWERCASE_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# The array libraries an --array-library package can be written on.
ARRAY_LIBRARIES = ("numpy",)


class NewBackendError(ValueError):
    """Input that `new-backend` refuses, or a write that failed; nothing is left written either way."""


@dataclass(frozen=True)
class PackageSpec:
    """What both kinds of package share: the backend's name and the names made from it. Each kind adds
    its own fields and the `templates` of its files."""

    name: str
    templates: ClassVar[dict[str, str]] = {}

    @property
    def distribution(self) -> str:
        return f"candelabra-{self.name}"

    @property
    def package(self) -> str:
        return f"candelabra_{self.name}"

    @property
    def class_prefix(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))

    @property
    def class_name(self) -> str:
        return self.class_prefix + "Backend"

    def check(self) -> None:
        """Raises NewBackendError saying what is allowed where a field would not make a working package."""
        if not _LOWERCASE_IDENTIFIER.fullmatch(self.name):
            raise NewBackendError(f"backend name {self.name!r} is not a lowercase Python identifier: use a "
                                  f"lowercase letter, then lowercase letters, digits or underscores (e.g. acme, "
                                  f"my_npu); it names the package candelabra_NAME")

    def template_values(self) -> dict[str, str]:
        return {"name": self.name, "distribution": self.distribution, "package": self.package,
                "class_name": self.class_name, "candelabra_requirement": _candelabra_requirement()}


@dataclass(frozen=True)
class TorchDeviceSpec(PackageSpec):
    """A backend for a PyTorch device extension: what the scaffolded class declares (AcceleratorBackend's
    attributes of the same names)."""

    device_type: str
    extension: str
    visible_devices_variable: str
    distributed_backend: str = "gloo"
    templates: ClassVar[dict[str, str]] = backend_package_templates.FILES

    @classmethod
    def with_defaults(cls, name: str, device_type: str, extension: str | None = None,
                      visible_devices_variable: str | None = None, distributed_backend: str | None = None
                      ) -> TorchDeviceSpec:
        """The spec with each option not given derived from `device_type`: extension "torch_TYPE",
        variable "TYPE_VISIBLE_DEVICES" (upper case), collective library "gloo"."""
        return cls(name, device_type, extension or f"torch_{device_type}",
                   visible_devices_variable or f"{device_type.upper()}_VISIBLE_DEVICES",
                   distributed_backend or "gloo")

    def check(self) -> None:
        super().check()
        if not _IDENTIFIER.fullmatch(self.device_type):
            raise NewBackendError(f"--torch-device {self.device_type!r} is not an identifier: give the device type "
                                  f"the extension registers with torch, as in torch.device('npu:0') (letters, "
                                  f"digits, underscores, not starting with a digit)")
        if not _MODULE_PATH.fullmatch(self.extension):
            raise NewBackendError(f"--extension {self.extension!r} is not a module name: give what `import` takes, "
                                  f"e.g. torch_npu or vendor.torch_ext")
        if not _IDENTIFIER.fullmatch(self.visible_devices_variable):
            raise NewBackendError(f"--visible-devices-variable {self.visible_devices_variable!r} is not an "
                                  f"environment variable name: letters, digits and underscores, not starting "
                                  f"with a digit")
        if not _IDENTIFIER.fullmatch(self.distributed_backend):
            raise NewBackendError(f"--distributed-backend {self.distributed_backend!r} is not a torch.distributed "
                                  f"backend name such as gloo, hccl or xccl")

    def template_values(self) -> dict[str, str]:
        return {**super().template_values(), "device_type": self.device_type, "extension": self.extension,
                "visible_devices_variable": self.visible_devices_variable,
                "distributed_backend": self.distributed_backend}


@dataclass(frozen=True)
class ArrayLibrarySpec(PackageSpec):
    """A backend for a device whose runtime hands out arrays of its own, written on `array_library`'s
    arrays: host numpy arrays in through `to_device`, out through `to_host`, the library's in between."""

    array_library: str = "numpy"
    templates: ClassVar[dict[str, str]] = array_backend_templates.FILES

    @property
    def ops_class_name(self) -> str:
        return self.class_prefix + "Ops"

    def check(self) -> None:
        super().check()
        if self.array_library not in ARRAY_LIBRARIES:
            raise NewBackendError(f"--array-library {self.array_library!r} is not one the scaffold is written "
                                  f"on; it offers {', '.join(ARRAY_LIBRARIES)} (the host standing in for the "
                                  f"device, whose calls you then replace with your runtime's)")

    def template_values(self) -> dict[str, str]:
        return {**super().template_values(), "ops_class_name": self.ops_class_name,
                "array_library": self.array_library}


def write_package(spec: PackageSpec, parent: str | Path = ".") -> Path:
    """Writes the package folder `parent`/candelabra-NAME and returns its path. Raises NewBackendError,
    having written nothing, for a spec its `check` refuses, a name an installed plugin has, a `parent`
    that is not a folder, or a target that exists and is not an empty folder. The files are written into
    a hidden sibling folder first and renamed into place, so a write that fails half-way leaves nothing."""
    spec.check()
    parent = Path(parent)
    target = parent / spec.distribution
    _check_target(parent, target)
    check_name_free(spec.name)
    files = render(spec)
    staging = parent / f".{spec.distribution}.{secrets.token_hex(4)}.partial"
    try:
        staging.mkdir()
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        if target.exists():
            target.rmdir()  # checked to be empty; renaming onto a folder is not portable
        staging.rename(target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise NewBackendError(f"cannot write {target}: {exc}; nothing was written") from exc
        raise
    return target


def check_name_free(name: str) -> None:
    """Raises NewBackendError if an installed backend is called `name`, or an installed plugin is (a
    second plugin of the same name would not load)."""
    plugins = installed_plugins()
    backends = {registration.name: registration.source.distribution
                for registration in plugins.backends.registrations()}
    if name in backends:
        raise NewBackendError(f"backend name {name!r} is taken by {backends[name]}; pick a name no installed "
                              f"backend has (installed: {', '.join(sorted(backends))})")
    sources = [*plugins.sources.values(), *(broken.source for broken in plugins.broken)]
    for source in sources:
        if source.plugin == name:
            raise NewBackendError(f"{name!r} is the name of an installed candelabra plugin, from "
                                  f"{source.distribution}; a second plugin of that name would not load, so pick "
                                  f"another name")


def render(spec: PackageSpec) -> dict[str, str]:
    """The package's files, path relative to its folder -> text."""
    values = spec.template_values()
    return {Template(path).substitute(values): Template(text).substitute(values)
            for path, text in spec.templates.items()}


def _check_target(parent: Path, target: Path) -> None:
    if not parent.is_dir():
        raise NewBackendError(f"--dir {parent}: no such folder; create it first, or leave --dir out to write "
                              f"into the current directory")
    if target.is_dir():
        if any(target.iterdir()):
            raise NewBackendError(f"{target} already exists and is not empty; remove it, or pass --dir to "
                                  f"write somewhere else")
    elif target.exists():
        raise NewBackendError(f"{target} already exists and is not a folder; remove it, or pass --dir to "
                              f"write somewhere else")


def _candelabra_requirement() -> str:
    """candelabra at least as new as this one, whose classes the package is written against."""
    try:
        return f"candelabra>={importlib.metadata.version('candelabra')}"
    except importlib.metadata.PackageNotFoundError:
        return "candelabra"
