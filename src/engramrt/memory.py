"""How much memory or disk a store may take, probed before it allocates, and the
``cudaHostRegister`` call that page-locks host rows for the device.

Used by the storage tiers, the row cache and the shared host tables. Callers
go through the module (``memory.host_available_bytes()``), so tests can
monkeypatch one probe to simulate a small machine.
"""

from __future__ import annotations

import itertools
import os
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engramrt.errors import CapacityError

__all__ = [
    "REGISTER_PIECE_BYTES",
    "copy_into_host",
    "cuda_host_register",
    "device_free_bytes",
    "disk_free_bytes",
    "format_bytes",
    "host_available_bytes",
    "register_spans",
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


REGISTER_PIECE_BYTES = 1 << 30
"""``cudaHostRegister`` pins a range's pages in the calling thread; a range of at least
two pieces of this size is registered as pieces, from one thread per piece up to the
CPUs this process may use, at once (faster on a large table: BENCHMARKS.md, "Full size
on one H200"). Piece bounds fall on 2 MiB, so no page is in two registrations. The
device reads the pieces as one range (each registered byte at its host address, as
:class:`engramrt.lookup.mapped.MappedHostRows` assumes), but one CUDA copy
(``cudaMemcpy``) may not span two pieces: copy a registered range to or from a device
through an unregistered buffer, or piece by piece."""

_PAGE_ALIGN = 1 << 21


def register_spans(pointer: int, nbytes: int) -> list[tuple[int, int]]:
    """The ``(address, bytes)`` pieces :func:`cuda_host_register` registers for a range."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    pieces = max(1, min(cpus, nbytes // REGISTER_PIECE_BYTES))
    if pieces == 1:
        return [(pointer, nbytes)]
    end = pointer + nbytes
    step = -(-nbytes // pieces)
    bounds = [pointer]
    for k in range(1, pieces):
        bound = -(-(pointer + k * step) // _PAGE_ALIGN) * _PAGE_ALIGN
        if bounds[-1] < bound < end:
            bounds.append(bound)
    bounds.append(end)
    return [(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


def _unregister(pointers: list[int], keep_alive: object) -> None:
    # Runs before ``keep_alive`` (what holds the pages) can be freed or unmapped.
    del keep_alive
    cudart = torch.cuda.cudart()
    for pointer in pointers:
        cudart.cudaHostUnregister(pointer)


def copy_into_host(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for a ``target`` in host memory that may be registered in
    pieces (:data:`REGISTER_PIECE_BYTES`): one CUDA copy may not span two, so a source on
    a device comes to unregistered host memory first."""
    target.copy_(source if source.device.type == "cpu" else source.cpu())


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
    A large range is registered in pieces, several at once (see
    :data:`REGISTER_PIECE_BYTES`); a failure undoes the pieces already registered.
    """
    flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    if read_only:
        flags |= _CUDA_HOST_REGISTER_READ_ONLY
    spans = register_spans(host.data_ptr(), host.numel() * host.element_size())
    cudart = torch.cuda.cudart()

    def register(span: tuple[int, int]) -> int:
        return int(cudart.cudaHostRegister(span[0], span[1], flags))

    if len(spans) == 1:
        statuses = [register(spans[0])]
    else:
        with ThreadPoolExecutor(len(spans), thread_name_prefix="engramrt-register") as pool:
            statuses = list(pool.map(register, spans))
    done = [span[0] for span, status in zip(spans, statuses, strict=True) if status == 0]
    failed = [status for status in statuses if status != 0]
    if failed:
        _unregister(done, None)
        return failed[0]
    weakref.finalize(owner, _unregister, done, host if keep_alive is None else keep_alive)
    return 0
