"""Choosing between a Triton kernel and its reference.

Every operation has a plain PyTorch/numpy reference that defines the result
and one or more Triton kernels that are optimisations of it. ``backend`` is
one of:

- ``"auto"``: the Triton kernel when the data lives on a CUDA device (or
  when Triton's interpreter is switched on with ``TRITON_INTERPRET=1``),
  the reference otherwise;
- ``"triton"``: always the kernel (on CPU tensors only under the
  interpreter);
- ``"reference"``: always the reference.

Triton is imported lazily, inside the kernel modules, so ``import engramrt``
never touches a GPU or compiles anything.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from engramrt.errors import EngramError

Backend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through its CPU interpreter.

    Read from the environment on every call (tests switch it); ``os.environ``
    lookups cost well under a microsecond.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported; looked up once per process. Before triton is
    imported the search reads the file system, and every kernel call asks (a host-tier
    lookup on a CPU, five times)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device | str) -> Literal["triton", "reference"]:
    """Turn a user's ``backend`` into the implementation that will run on ``device``."""
    if backend not in BACKENDS:
        raise EngramError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "reference":
        return "reference"
    runnable = triton_installed() and (device.type == "cuda" or interpreter_enabled())
    if backend == "triton":
        if not runnable:
            raise EngramError(
                f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 with triton "
                f"installed; got data on device {device} (triton installed: {triton_installed()})"
            )
        return "triton"
    return "triton" if runnable else "reference"
