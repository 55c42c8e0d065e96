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

:func:`make_store` builds one, checking capacity first. Each tier is a class
registered in :data:`TIERS` by :func:`register_tier`; a new tier is a new
module whose class carries the decorator (and is imported once).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engramrt import memory
from engramrt._device import resolve_device
from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup.tiers.base import (
    TIERS,
    KernelRowStore,
    RowStore,
    register_tier,
    tier_class,
)
from engramrt.lookup.tiers.device import DeviceRowStore
from engramrt.lookup.tiers.disk import DiskRowStore
from engramrt.lookup.tiers.host_gather import HostGatherRowStore
from engramrt.lookup.tiers.host_rows import HostRows, MappedFileRows, PrivateHostRows
from engramrt.lookup.tiers.synthetic import SyntheticRowStore
from engramrt.lookup.tiers.uva import UvaRowStore
from engramrt.packed import row_bytes_for, row_width_for

__all__ = [
    "AUTO_DEVICE_HEADROOM_BYTES",
    "TIERS",
    "DeviceRowStore",
    "DiskRowStore",
    "HostGatherRowStore",
    "HostRows",
    "KernelRowStore",
    "MappedFileRows",
    "PrivateHostRows",
    "RowStore",
    "SyntheticRowStore",
    "UvaRowStore",
    "choose_tier",
    "make_store",
    "register_tier",
    "tier_class",
]

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
    **options: Any,
) -> RowStore:
    """Build a :class:`RowStore` of ``tier`` for rows ``[row_begin, row_begin + num_rows)``.

    Args:
        tier: ``"auto"`` (see :func:`choose_tier`) or a name of :data:`TIERS`.
        num_rows, E: table size; taken from ``packed`` when it is given
            (then they must agree), or for ``"disk"`` from the file.
        packed: optional ``[num_rows, E + E/32]`` uint8 rows to fill the store
            with (CPU or device). Without it the store is allocated, unfilled:
            use :meth:`RowStore.write_rows`.
        path: the packed-row file of tier ``"disk"``: created (after a
            free-space check) when ``packed`` is given, opened otherwise.
        device: the compute device (default: the current CUDA device, else CPU).
        options: the tier's own keyword arguments, checked against
            :meth:`RowStore.options`: the shard and checks (``row_begin``,
            ``col_begin``, ``col_end``, ``validate``, ``check_ids``) for every
            tier; ``backend``, ``kernel`` (a
            :class:`~engramrt.lookup.settings.LookupKernelConfig`) and the
            host-gather settings (``chunk_rows``, ``num_threads``,
            ``gpu_reads``, ``gpu_share``) where the tier takes them.

    Raises:
        CapacityError: the chosen memory or disk is too small.
        ValidationError: inconsistent sizes, an unknown tier or an option the
            tier does not take (the message lists those it does).
    """
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
    compute_device = resolve_device(device)
    if tier == "auto":
        if num_rows is None:  # nothing to size memory by: serve the file at ``path``
            tier = "disk"
        else:
            tier = choose_tier(num_rows * row_bytes_for(E), compute_device, path)
    store = tier_class(tier).build(
        num_rows, E, path=path, new_file=packed is not None, device=compute_device, **options
    )
    if packed is not None:
        store.write_rows(0, packed)
        store.flush()
    return store
