"""A backend for a PyTorch device extension (Enflame's torch_gcu, Ascend's torch_npu, Intel's xpu,
...): the torch backend on the extension's device type, plus a table of vendor kernels that replace
torch ops one by one.

A vendor subclasses `AcceleratorBackend`, names its device type, extension module, visible-devices
variable and collective library, and lists its kernels in `overrides`: op name -> `VendorKernel`.
Each kernel is looked up when the backend is built. One that cannot be found falls back to the torch
op with the reason logged, unless it was asked for explicitly (`required=True`), which makes the
failure an error. A kernel may also decline a call by returning NotImplemented (a dtype it lacks):
the torch op runs instead. `kernel_record()` says which ran, and conformance reports it per case.

Stand-in: `CANDELABRA_STAND_IN=gcu` (a comma-separated list of device types) runs such a backend,
unchanged, on torch's CPU device presented under the vendor's name, its kernels taken from the
modules `stand_in_modules` names in place of the vendor's. That is how the template and every
scaffolded backend pass conformance on a machine without the hardware.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from candelabra.backends.torch.backend import CPU_DTYPES, TorchBackend, torch
from candelabra.core.contract.backend import Probe
from candelabra.core.contract.device import Device
from candelabra.core.contract.ops import OP_NAMES

log = logging.getLogger("candelabra")

STAND_IN_VARIABLE = "CANDELABRA_STAND_IN"
OVERRIDE, FELL_BACK = "override", "fell back"


class KernelLookupError(RuntimeError):
    """A vendor kernel asked for explicitly (`required=True`) could not be found."""


@dataclass(frozen=True)
class VendorKernel:
    """The vendor's kernel for one op. `target` names a callable, "package.module:attribute", or an op
    registered with torch ("torch.ops.namespace:name"). `adapt`, where given, turns that callable
    into the op (the op's own arguments, without self); without it the callable is the op. `requires`
    names a module to import first, one that registers the target with torch. `required`: an explicit
    override, whose lookup failure is an error instead of a logged fall-back."""

    target: str
    adapt: Callable[[Callable], Callable] | None = None
    requires: str | None = None
    required: bool = False


def stand_in_device_types() -> frozenset[str]:
    """The device types `CANDELABRA_STAND_IN` asks to be stood in for by torch's CPU device."""
    value = os.environ.get(STAND_IN_VARIABLE, "")
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def resolve(target: str) -> Callable:
    """The callable `target` names ("module.path:attribute.path"). Raises LookupError saying what is
    missing: the module, or the attribute in it."""
    module_path, _, attributes = target.partition(":")
    if not module_path or not attributes:
        raise LookupError(f"{target!r} is not 'module:attribute'")
    value, imported = _import_longest(module_path)
    for name in (*module_path.split(".")[len(imported.split(".")):], *attributes.split(".")):
        try:
            value = getattr(value, name)
        except (AttributeError, RuntimeError) as exc:  # torch.ops raises RuntimeError for an unknown op
            raise LookupError(f"{target}: {imported} has no {name!r} ({type(exc).__name__})") from None
    if not callable(value):
        raise LookupError(f"{target} is a {type(value).__name__}, not a callable")
    return value


def _import_longest(module_path: str) -> tuple[Any, str]:
    """The longest importable prefix of `module_path` (torch.ops.x is an attribute, not a module)."""
    parts = module_path.split(".")
    failure = None
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            return importlib.import_module(name), name
        except ModuleNotFoundError as exc:
            failure = failure or exc
            if exc.name is not None and not name.startswith(exc.name):
                raise LookupError(f"{module_path}: importing {name} needs {exc.name}, which is not installed") from exc
        except Exception as exc:  # noqa: BLE001 - a vendor module that fails to import is a reason to fall back
            raise LookupError(f"{module_path}: importing {name} failed: {type(exc).__name__}: {exc}") from exc
    raise LookupError(f"{module_path}: {failure}")


class _ForDevice:
    """A class attribute that is `on_device` on the hardware and `on_stand_in` on the CPU stand-in."""

    def __init__(self, on_device: str, on_stand_in: str) -> None:
        self.on_device, self.on_stand_in = on_device, on_stand_in

    def __get__(self, instance, owner):
        return getattr(owner, self.on_stand_in if owner.stand_in() else self.on_device)


class AcceleratorBackend(TorchBackend):
    """The torch backend on a PyTorch device extension's device, with vendor kernel overrides."""

    # What a vendor's subclass sets.
    device_type: ClassVar[str] = ""  # the extension's torch device type, e.g. "gcu"
    extension: ClassVar[str] = ""  # the module that registers it with torch, e.g. "torch_gcu"
    visible_devices_variable: ClassVar[str] = ""  # e.g. "TOPS_VISIBLE_DEVICES"
    distributed_backend: ClassVar[str] = "gloo"  # its collective library's torch.distributed name
    device_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    overrides: ClassVar[dict[str, VendorKernel]] = {}
    # Vendor module -> the module standing in for it on the CPU stand-in.
    stand_in_modules: ClassVar[dict[str, str]] = {}

    dtypes = _ForDevice("device_dtypes", "stand_in_dtypes")
    stand_in_dtypes: ClassVar[tuple[str, ...]] = CPU_DTYPES

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        unknown = sorted(set(cls.overrides) - set(OP_NAMES))
        if unknown:
            raise TypeError(f"{cls.__name__}.overrides names {', '.join(unknown)}, which are not ops; "
                            f"the ops are {', '.join(OP_NAMES)}")

    def __init__(self, device: Device | None = None) -> None:
        if not self.stand_in() and self.extension:
            importlib.import_module(self.extension)  # registers the device type with torch
        super().__init__(device)
        self.fallback_reasons: dict[str, str] = {}
        self._record: dict[str, set[str]] = {}
        self._install_overrides()

    @classmethod
    def stand_in(cls) -> bool:
        """Whether CANDELABRA_STAND_IN names this backend's device type: torch's CPU device stands in."""
        return cls.device_type in stand_in_device_types()

    @classmethod
    def runs_on(cls) -> str:
        return "cpu" if cls.stand_in() else cls.device_type

    @classmethod
    def probe(cls) -> Probe:
        if torch is None:
            return Probe(False, f"torch is not installed; pip install torch and {cls.extension}")
        if cls.stand_in():
            return Probe(True, priority=1, detail=f"a stand-in for {cls.device_type}: torch on the CPU "
                                                  f"({STAND_IN_VARIABLE}={os.environ[STAND_IN_VARIABLE]}), for testing")
        try:
            importlib.import_module(cls.extension)
        except ImportError as exc:
            return Probe(False, f"{cls.extension} is not installed ({exc}); install the vendor's PyTorch extension, "
                                f"or set {STAND_IN_VARIABLE}={cls.device_type} to run on a CPU stand-in")
        except Exception as exc:  # noqa: BLE001 - a broken extension is a reason, not a crash
            return Probe(False, f"{cls.extension} failed to import: {type(exc).__name__}: {exc}")
        count = cls.device_count()
        if count == 0:
            where = cls.visible_devices_variable
            seen = f"{where}={os.environ[where]!r}" if where and where in os.environ else f"{where} is not set"
            return Probe(False, f"no {cls.device_type.upper()} device visible ({seen})")
        return Probe(True, priority=100, detail=f"{count} {cls.device_type} device(s), {cls.extension}")

    @classmethod
    def device_count(cls) -> int:
        if torch is None:
            return 1
        if cls.stand_in():
            return super().device_count()  # the CPU's: shares of its cores
        module = getattr(torch, cls.device_type, None)
        if module is None:
            try:
                module = getattr(importlib.import_module(cls.extension), cls.device_type, None)
            except Exception:  # noqa: BLE001 - no extension, no device
                return 0
        try:
            return int(module.device_count()) if module is not None else 0
        except Exception:  # noqa: BLE001 - a driver error means no usable device
            return 0

    def _configure_device(self) -> None:
        if self.stand_in():
            log.info("%s backend on a CPU stand-in (%s): torch's CPU device presented as %s", self.name,
                     STAND_IN_VARIABLE, self.device_type)
            super()._configure_device()
            return
        module = getattr(torch, self.device_type, None)
        if module is not None and hasattr(module, "set_device"):
            module.set_device(self.torch_device)

    # kernel overrides

    def _install_overrides(self) -> None:
        for op, kernel in self.overrides.items():
            base = getattr(self.ops, op)
            try:
                if kernel.requires:
                    _import_longest(self._stand_in_module(kernel.requires))
                found = resolve(self._stand_in_target(kernel.target))
                implementation = kernel.adapt(found) if kernel.adapt else found
            except LookupError as exc:
                if kernel.required:
                    raise KernelLookupError(f"{self.name}: the {op} kernel {kernel.target} was asked for explicitly "
                                            f"and cannot be used: {exc}") from exc
                self.fallback_reasons[op] = str(exc)
                if self.stand_in():  # on the stand-in every kernel should be found: a mapping is missing
                    log.warning("%s: %s falls back to torch on the stand-in: %s; map its module in "
                                "stand_in_modules", self.name, op, exc)
                else:
                    log.info("%s: %s falls back to torch: %s", self.name, op, exc)
                setattr(self.ops, op, self._recorded(op, base))
                continue
            setattr(self.ops, op, self._dispatching(op, implementation, base))

    def _stand_in_target(self, target: str) -> str:
        module_path, _, attributes = target.partition(":")
        return f"{self._stand_in_module(module_path)}:{attributes}"

    def _stand_in_module(self, module_path: str) -> str:
        """`module_path`, or on the stand-in the module standing in for it."""
        if self.stand_in():
            for vendor, stand_in in self.stand_in_modules.items():
                if module_path == vendor or module_path.startswith(vendor + "."):
                    return stand_in + module_path[len(vendor):]
        return module_path

    def _dispatching(self, op: str, kernel: Callable, base: Callable) -> Callable:
        @functools.wraps(base)
        def run(*args, **kwargs):
            result = kernel(*args, **kwargs)
            if result is NotImplemented:
                self._record.setdefault(op, set()).add(FELL_BACK)
                return base(*args, **kwargs)
            self._record.setdefault(op, set()).add(OVERRIDE)
            return result

        return run

    def _recorded(self, op: str, base: Callable) -> Callable:
        @functools.wraps(base)
        def run(*args, **kwargs):
            self._record.setdefault(op, set()).add(FELL_BACK)
            return base(*args, **kwargs)

        return run

    def kernel_record(self) -> dict[str, str]:
        record = {op: ", ".join(sorted(ran, reverse=True)) for op, ran in self._record.items()}
        self._record.clear()
        return record
