"""An import-only stand-in for torchvision in the engine test environment.

PyPI's torchvision wheels are CUDA builds whose operators do not load beside
the CPU torch, so ``import torchvision`` fails there. SGLang, vLLM and
transformers import it at module level (image preprocessing) but the engine
tests never call it: every submodule and name imports, and calling one raises.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import NoReturn

__version__ = "0.0.0+engramrt.shim"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def missing(qualname: str) -> object:
    """A stand-in for ``qualname`` that raises when called."""

    def call(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"{qualname}: torchvision is an import-only shim in the engine tests")

    call.__qualname__ = call.__name__ = qualname.rsplit(".", 1)[-1]
    return call


def _module_getattr(prefix: str):  # type: ignore[no-untyped-def]
    def getattr_(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return missing(f"{prefix}.{name}")

    return getattr_


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``torchvision.*`` submodule as an empty module of stand-ins."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_ShimFinder())
__getattr__ = _module_getattr(__name__)
