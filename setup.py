"""Builds the torch backend's C kernels ahead of time, one library per ISA variant, when the package is
built or installed (backends/torch/cpu/kernel_build.py says how). Everything else is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kernel_build", ROOT / "backends" / "torch" / "cpu" / "kernel_build.py")
kernel_build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kernel_build  # its dataclasses look their module up there
_spec.loader.exec_module(kernel_build)
PACKAGE = "candelabra.backends.torch.cpu"
VARIANTS = {f"{PACKAGE}.{variant.library_name.removesuffix('.so')}": variant for variant in kernel_build.variants_for()}


class BuildKernels(build_ext):
    """Each variant's library compiled by kernel_build; one that does not compile is left out with a
    warning, and the torch backend then says why it serves on torch's own ops."""

    def get_ext_filename(self, fullname: str) -> str:
        # loaded with ctypes by its own name, never imported: no Python ABI tag
        return str(Path(*fullname.split("."))) + ".so"

    def run(self) -> None:
        self.failed: set[str] = set()
        super().run()
        self._drop_failed()

    def copy_extensions_to_source(self) -> None:  # an editable install's copy into the checkout
        self._drop_failed()
        super().copy_extensions_to_source()

    def _drop_failed(self) -> None:
        """What was not built is not an output to copy or install."""
        self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

    def build_extension(self, ext: Extension) -> None:
        variant = VARIANTS[ext.name]
        error = kernel_build.build(variant, Path(self.get_ext_fullpath(ext.name)))
        if error:
            self.failed.add(ext.name)
            self.warn(f"the {variant.name} CPU kernels were not built: {error}")


setup(ext_modules=[Extension(name, sources=[]) for name in VARIANTS], cmdclass={"build_ext": BuildKernels})
