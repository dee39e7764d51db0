"""`candelabra new-backend`: writes a pip-installable package with a backend for a PyTorch device
extension, built on `candelabra.backends.torch.accelerator.AcceleratorBackend`, that passes
conformance on the CPU stand-in as written. The file texts are in `backend_package_templates`.
"""

from __future__ import annotations

import importlib.metadata
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template

from candelabra.core.commands import backend_package_templates
from candelabra.plugins import installed_plugins

_LOWERCASE_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class NewBackendError(ValueError):
    """Input that `new-backend` refuses, or a write that failed; nothing is left written either way."""


@dataclass(frozen=True)
class BackendSpec:
    """What the scaffolded backend class declares (AcceleratorBackend's attributes of the same names)."""

    name: str
    device_type: str
    extension: str
    visible_devices_variable: str
    distributed_backend: str = "gloo"

    @classmethod
    def with_defaults(cls, name: str, device_type: str, extension: str | None = None,
                      visible_devices_variable: str | None = None, distributed_backend: str | None = None
                      ) -> BackendSpec:
        """The spec with each option not given derived from `device_type`: extension "torch_TYPE",
        variable "TYPE_VISIBLE_DEVICES" (upper case), collective library "gloo"."""
        return cls(name, device_type, extension or f"torch_{device_type}",
                   visible_devices_variable or f"{device_type.upper()}_VISIBLE_DEVICES",
                   distributed_backend or "gloo")

    @property
    def distribution(self) -> str:
        return f"candelabra-{self.name}"

    @property
    def package(self) -> str:
        return f"candelabra_{self.name}"

    @property
    def class_name(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_")) + "Backend"


def write_package(spec: BackendSpec, parent: str | Path = ".") -> Path:
    """Writes the package folder `parent`/candelabra-NAME and returns its path. Raises NewBackendError,
    having written nothing, for a spec `check_spec` refuses, a name an installed plugin has, a `parent`
    that is not a folder, or a target that exists and is not an empty folder. The files are written into
    a hidden sibling folder first and renamed into place, so a write that fails half-way leaves nothing."""
    check_spec(spec)
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


def check_spec(spec: BackendSpec) -> None:
    """Raises NewBackendError saying what is allowed where a field would not make a working package."""
    if not _LOWERCASE_IDENTIFIER.fullmatch(spec.name):
        raise NewBackendError(f"backend name {spec.name!r} is not a lowercase Python identifier: use a lowercase "
                              f"letter, then lowercase letters, digits or underscores (e.g. acme, my_npu); it "
                              f"names the package candelabra_NAME")
    if not _IDENTIFIER.fullmatch(spec.device_type):
        raise NewBackendError(f"--torch-device {spec.device_type!r} is not an identifier: give the device type the "
                              f"extension registers with torch, as in torch.device('npu:0') (letters, digits, "
                              f"underscores, not starting with a digit)")
    if not _MODULE_PATH.fullmatch(spec.extension):
        raise NewBackendError(f"--extension {spec.extension!r} is not a module name: give what `import` takes, "
                              f"e.g. torch_npu or vendor.torch_ext")
    if not _IDENTIFIER.fullmatch(spec.visible_devices_variable):
        raise NewBackendError(f"--visible-devices-variable {spec.visible_devices_variable!r} is not an environment "
                              f"variable name: letters, digits and underscores, not starting with a digit")
    if not _IDENTIFIER.fullmatch(spec.distributed_backend):
        raise NewBackendError(f"--distributed-backend {spec.distributed_backend!r} is not a torch.distributed "
                              f"backend name such as gloo, hccl or xccl")


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


def render(spec: BackendSpec) -> dict[str, str]:
    """The package's files, path relative to its folder -> text."""
    values = {
        "name": spec.name,
        "distribution": spec.distribution,
        "package": spec.package,
        "class_name": spec.class_name,
        "device_type": spec.device_type,
        "extension": spec.extension,
        "visible_devices_variable": spec.visible_devices_variable,
        "distributed_backend": spec.distributed_backend,
        "candelabra_requirement": _candelabra_requirement(),
    }
    return {Template(path).substitute(values): Template(text).substitute(values)
            for path, text in backend_package_templates.FILES.items()}


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
    """candelabra at least as new as this one, whose AcceleratorBackend the package is written against."""
    try:
        return f"candelabra>={importlib.metadata.version('candelabra')}"
    except importlib.metadata.PackageNotFoundError:
        return "candelabra"
