"""How much memory or disk a tier may take, probed before it allocates.

Tiers call these through the module (``memory.host_available_bytes()``),
so tests can monkeypatch one probe to simulate a small machine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from engramrt.errors import CapacityError

__all__ = [
    "device_free_bytes",
    "disk_free_bytes",
    "format_bytes",
    "host_available_bytes",
    "require",
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
