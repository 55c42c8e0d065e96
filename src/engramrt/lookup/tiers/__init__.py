"""Storage tiers for packed tables, all behind :class:`RowStore`.

=========  ==========================================================  =====================
tier       where the rows live / how a lookup reaches them              host sync per lookup
=========  ==========================================================  =====================
device     device memory; one gather + dequantise kernel                no (graph-capturable)
uva        page-locked host memory read by the same kernel over PCIe    no (graph-capturable)
host       host memory; CPU threads gather unique rows, bulk H2D copy   yes (the unique ids)
disk       a raw packed-row file, memory-mapped, then as ``host``      yes
synthetic  nowhere: rows computed from their ids (demos, tests)        no
=========  ==========================================================  =====================

:func:`make_store` builds one, checking capacity first.
"""

from __future__ import annotations

import os

import torch

from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup.reference import row_bytes_for, row_width_for
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelSettings
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.base import RowStore, default_compute_device
from engramrt.lookup.tiers.device import DeviceRowStore
from engramrt.lookup.tiers.disk import DiskRowStore
from engramrt.lookup.tiers.host_gather import DEFAULT_CHUNK_ROWS, GPU_SHARE, HostGatherRowStore
from engramrt.lookup.tiers.synthetic import SyntheticRowStore
from engramrt.lookup.tiers.uva import UvaRowStore

__all__ = [
    "AUTO_DEVICE_HEADROOM_BYTES",
    "TIERS",
    "DeviceRowStore",
    "DiskRowStore",
    "HostGatherRowStore",
    "RowStore",
    "SyntheticRowStore",
    "UvaRowStore",
    "choose_tier",
    "make_store",
]

TIERS: tuple[str, ...] = ("auto", "device", "uva", "host", "disk")

AUTO_DEVICE_HEADROOM_BYTES = 8 * 2**30
"""Device memory ``tier="auto"`` leaves free for weights and activations."""


def choose_tier(nbytes: int, device: torch.device, path: str | os.PathLike[str] | None) -> str:
    """The tier ``"auto"`` resolves to for a table of ``nbytes`` served on ``device``.

    Device memory when it fits with :data:`AUTO_DEVICE_HEADROOM_BYTES` to
    spare (on a CPU device: when host memory fits), then host memory, then
    the file at ``path``. UVA is never chosen: its random PCIe reads were
    measured slower than the host tier's gather + bulk copy.
    """
    host = memory.host_available_bytes()
    if device.type == "cuda":
        free = memory.device_free_bytes(device)
        if nbytes + AUTO_DEVICE_HEADROOM_BYTES <= free:
            return "device"
        if nbytes <= host:
            return "host"
    elif nbytes <= host:
        return "device"
    if path is not None:
        return "disk"
    device_note = (
        f"{device} has {memory.format_bytes(memory.device_free_bytes(device))} free "
        f"(keeping {memory.format_bytes(AUTO_DEVICE_HEADROOM_BYTES)} spare), "
        if device.type == "cuda"
        else ""
    )
    raise CapacityError(
        f"tier='auto' needs {memory.format_bytes(nbytes)} for the table but {device_note}host "
        f"memory has {memory.format_bytes(host)} available and no path was given for tier='disk'"
    )


def make_store(
    tier: str = "auto",
    *,
    num_rows: int | None = None,
    E: int | None = None,
    packed: torch.Tensor | None = None,
    path: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
    row_begin: int = 0,
    col_begin: int = 0,
    col_end: int | None = None,
    validate: bool = False,
    backend: str = "auto",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    num_threads: int | None = None,
    gpu_reads: bool | None = None,
    gpu_share: float = GPU_SHARE,
    kernel: LookupKernelSettings | None = None,
) -> RowStore:
    """Build a :class:`RowStore` of ``tier`` for rows ``[row_begin, row_begin + num_rows)``.

    Args:
        tier: ``"auto"``, ``"device"``, ``"uva"``, ``"host"`` or ``"disk"``.
        num_rows, E: table size; taken from ``packed`` when it is given
            (then they must agree), or for ``"disk"`` from the file.
        packed: optional ``[num_rows, E + E/32]`` uint8 rows to fill the store
            with (CPU or device). Without it the store is allocated, unfilled:
            use :meth:`RowStore.write_rows`.
        path: the packed-row file of tier ``"disk"``: created (after a
            free-space check) when ``packed`` is given, opened otherwise.
        device: the compute device (default: the current CUDA device, else CPU).
        row_begin, col_begin, col_end, validate: the shard and checked mode,
            see :class:`RowStore`.
        backend: kernel or reference for the device/host/disk tiers.
        chunk_rows, num_threads: host-gather settings (``"host"``, ``"disk"``).
        gpu_reads, gpu_share: whether and how much the GPU reads host rows
            itself (``"host"``; see :class:`HostGatherRowStore`).
        kernel: the lookup kernel's settings (``"device"``, ``"uva"``, and
            ``"host"``'s GPU reads); None: the tier's default (host:
            :data:`engramrt.lookup.tiers.host_gather.HOST_READ_KERNEL`).

    Raises:
        CapacityError: the chosen memory or disk is too small.
        ValidationError: inconsistent sizes or an unknown tier.
    """
    if tier not in TIERS:
        raise ValidationError(f"tier = {tier!r}; expected one of {', '.join(TIERS)}")
    if packed is not None:
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValidationError(
                f"packed is {packed.dtype} {tuple(packed.shape)}; expected uint8 [num_rows, E + E/32]"
            )
        packed_width = row_width_for(packed.shape[1])
        if E is not None and packed_width != E:
            raise ValidationError(f"E = {E} but packed rows hold E = {packed_width} values")
        if num_rows is not None and num_rows != packed.shape[0]:
            raise ValidationError(f"num_rows = {num_rows} but packed has {packed.shape[0]} rows")
        E, num_rows = packed_width, packed.shape[0]
    if E is None:
        raise ValidationError("E = None; expected the values per row (or packed rows)")
    compute_device = torch.device(device) if device is not None else default_compute_device()
    if tier == "auto":
        if num_rows is None:  # nothing to size memory by: serve the file at ``path``
            tier = "disk"
        else:
            tier = choose_tier(num_rows * row_bytes_for(E), compute_device, path)
    if tier != "disk" and num_rows is None:
        raise ValidationError(f"num_rows = None for tier={tier!r}; expected the rows to hold")
    store: RowStore
    if tier == "disk":
        if path is None:
            raise ValidationError("path = None; expected the packed-row file of tier='disk'")
        store = DiskRowStore(
            path,
            num_rows,
            E,
            create=packed is not None,
            device=compute_device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            chunk_rows=chunk_rows,
            num_threads=num_threads,
            backend=backend,
        )
    elif tier == "host":
        assert num_rows is not None
        store = HostGatherRowStore(
            num_rows,
            E,
            device=compute_device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            chunk_rows=chunk_rows,
            num_threads=num_threads,
            backend=backend,
            gpu_reads=gpu_reads,
            gpu_share=gpu_share,
            **({} if kernel is None else {"kernel": kernel}),
        )
    elif tier == "uva":
        assert num_rows is not None
        store = UvaRowStore(
            num_rows,
            E,
            device=compute_device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            kernel=kernel or DEFAULT_KERNEL,
        )
    else:
        assert num_rows is not None
        store = DeviceRowStore(
            num_rows,
            E,
            device=compute_device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            backend=backend,
            kernel=kernel or DEFAULT_KERNEL,
        )
    if packed is not None:
        store.write_rows(0, packed)
        if isinstance(store, DiskRowStore):
            store.flush()
    return store
