"""How much memory or disk a store may take, probed before it allocates, and the
``cudaHostRegister`` call that page-locks host rows for the device.

Used by the storage tiers, the row cache and the shared host tables. Callers
go through the module (``memory.host_available_bytes()``), so tests can
monkeypatch one probe to simulate a small machine.
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path

import torch

from engramrt.errors import CapacityError

__all__ = [
    "cuda_host_register",
    "device_free_bytes",
    "disk_free_bytes",
    "format_bytes",
    "host_available_bytes",
    "require",
    "require_cuda_mapping",
]


def device_free_bytes(device: torch.device) -> int:
    """Free bytes on a CUDA device (``torch.cuda.mem_get_info``)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def host_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def disk_free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


def format_bytes(count: int) -> str:
    return f"{count} bytes ({count / 2**30:.2f} GiB)"


def require(what: str, needed: int, available: int, where: str) -> None:
    """Raise :class:`CapacityError` unless ``needed <= available``."""
    if needed > available:
        raise CapacityError(
            f"{what} needs {format_bytes(needed)} but {where} has only "
            f"{format_bytes(available)} available"
        )


_CUDA_HOST_REGISTER_PORTABLE = 0x01  # every device's context sees the pages locked
_CUDA_HOST_REGISTER_MAPPED = 0x02  # and mapped into its address space (UVA)
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # a PROT_READ mapping: pinning must not ask for write


def _unregister(pointer: int, keep_alive: object) -> None:
    # Runs before ``keep_alive`` (what holds the pages) can be freed or unmapped.
    del keep_alive
    torch.cuda.cudart().cudaHostUnregister(pointer)


def require_cuda_mapping(what: str, device: torch.device, advice: str = "") -> None:
    """Raise :class:`CapacityError` unless ``device`` is a usable CUDA device that host
    memory can be mapped into (``what`` names the setting asking for it)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CapacityError(
            f"{what} needs a CUDA device to map host memory into; got device {device} "
            f"(CUDA available: {torch.cuda.is_available()}){advice}"
        )


def cuda_host_register(
    owner: object, host: torch.Tensor, *, read_only: bool = False, keep_alive: object = None
) -> int:
    """Page-lock ``host``'s bytes and map them for every CUDA device; returns the cudaError.

    0 is success: the registration then lasts until ``owner`` is collected
    (``keep_alive``, default ``host``, is kept alive until it is undone).
    ``read_only`` registers a ``PROT_READ`` mapping (``cudaHostRegisterReadOnly``).
    """
    flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    if read_only:
        flags |= _CUDA_HOST_REGISTER_READ_ONLY
    pointer = host.data_ptr()
    status = int(
        torch.cuda.cudart().cudaHostRegister(pointer, host.numel() * host.element_size(), flags)
    )
    if status == 0:
        weakref.finalize(owner, _unregister, pointer, host if keep_alive is None else keep_alive)
    return status
