"""Storage tiers for tables of stored rows, all behind :class:`RowStore`.

=========  ==========================================================  =====================
tier       where the rows live / how a lookup reaches them              host sync per lookup
=========  ==========================================================  =====================
device     device memory; one gather + dequantise kernel                no (graph-capturable)
uva        page-locked host memory read by the same kernel over PCIe    no (graph-capturable)
host       host memory; CPU threads gather unique rows, bulk H2D copy   yes (the unique ids)
disk       a raw packed-row file, memory-mapped, then as ``host``      yes
synthetic  nowhere: rows computed from their ids (demos, tests)        no
=========  ==========================================================  =====================

:func:`make_store` builds one from a :class:`TablePlacement` (the tier and
its settings, the device), checking capacity first. Each tier is a class
registered in :data:`TIERS` by :func:`register_tier`, beside its settings
(a frozen :class:`TierOptions` subclass: :class:`DeviceOptions`,
:class:`UvaOptions`, :class:`HostOptions`, :class:`DiskOptions`,
:class:`SyntheticOptions`); a new tier is a new module whose class carries
the decorator (and is imported once). Every tier but ``synthetic`` holds rows of
any :class:`~engramrt.family.RowFormat` (``make_store(row_format=BF16)``); the
lookup kernels dequantise fp8 rows, and other rows are read as bytes
(:meth:`RowStore.gather_packed`).
"""

from __future__ import annotations

import os

import torch

from engramrt._device import default_compute_device
from engramrt.errors import ValidationError
from engramrt.family import FP8_UE8M0, RowFormat
from engramrt.layout import ColumnShard
from engramrt.lookup.tiers.base import (
    TIERS,
    KernelRowStore,
    RowStore,
    register_tier,
    row_bytes_of,
    tier_class,
)
from engramrt.lookup.tiers.device import DeviceOptions, DeviceRowStore
from engramrt.lookup.tiers.disk import DiskOptions, DiskRowStore
from engramrt.lookup.tiers.host_gather import HostGatherRowStore, HostOptions
from engramrt.lookup.tiers.host_rows import HostRows, MappedFileRows, PrivateHostRows
from engramrt.lookup.tiers.options import KernelTierOptions, TierOptions
from engramrt.lookup.tiers.placement import (
    AUTO_DEVICE_HEADROOM_BYTES,
    TablePlacement,
    check_placement,
    choose_tier,
)
from engramrt.lookup.tiers.synthetic import SyntheticOptions, SyntheticRowStore
from engramrt.lookup.tiers.uva import UvaOptions, UvaRowStore

__all__ = [
    "AUTO_DEVICE_HEADROOM_BYTES",
    "TIERS",
    "DeviceOptions",
    "DeviceRowStore",
    "DiskOptions",
    "DiskRowStore",
    "HostGatherRowStore",
    "HostOptions",
    "HostRows",
    "KernelRowStore",
    "KernelTierOptions",
    "MappedFileRows",
    "PrivateHostRows",
    "RowStore",
    "SyntheticOptions",
    "SyntheticRowStore",
    "TablePlacement",
    "TierOptions",
    "UvaOptions",
    "UvaRowStore",
    "check_placement",
    "choose_tier",
    "default_compute_device",
    "make_store",
    "register_tier",
    "row_bytes_of",
    "tier_class",
]


def _check_packed(
    packed: torch.Tensor, num_rows: int | None, E: int | None, row_format: RowFormat
) -> tuple[int, int]:
    """``(num_rows, E)`` of stored rows in ``row_format``, checked against those given."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        found = (
            f"{packed.dtype} {tuple(packed.shape)}"
            if isinstance(packed, torch.Tensor)
            else type(packed).__name__
        )
        raise ValidationError(
            f"packed is {found}; expected uint8 [num_rows, row_bytes] ({row_format.name} rows)"
        )
    packed_width = row_format.width_for(packed.shape[1])
    if E is not None and packed_width != E:
        raise ValidationError(f"E = {E} but packed rows hold E = {packed_width} values")
    if num_rows is not None and num_rows != packed.shape[0]:
        raise ValidationError(f"num_rows = {num_rows} but packed has {packed.shape[0]} rows")
    return packed.shape[0], packed_width


def make_store(
    placement: TablePlacement,
    *,
    num_rows: int | None = None,
    E: int | None = None,
    packed: torch.Tensor | None = None,
    shard: ColumnShard | None = None,
    path: str | os.PathLike[str] | None = None,
    new_file: bool | None = None,
    row_format: RowFormat = FP8_UE8M0,
) -> RowStore:
    """Build a :class:`RowStore` for one table, placed by ``placement``.

    Args:
        placement: the tier and its settings and the compute device (see
            :class:`TablePlacement`).
        num_rows, E: table size; taken from ``packed`` when it is given
            (then they must agree), from ``shard``, or for ``"disk"`` from
            the file.
        packed: optional ``[num_rows, row_bytes]`` uint8 rows to fill the store
            with (CPU or device; ``E + E/32`` bytes per fp8 row, bf16 rows viewed
            as bytes). Without it the store is allocated, unfilled: use
            :meth:`RowStore.write_rows`.
        shard: the rows ``[row_begin, row_end)`` and hash columns
            ``[col_begin, col_end)`` the store serves, one of the placement's
            rank (:meth:`TablePlacement.shard`); None: the whole table from
            row 0, every column (then the placement must be ``tp=1``).
        path: the packed-row file of tier ``"disk"``.
        new_file: create the file at ``path`` (after a free-space check)
            rather than open it; None: when ``packed`` is given.
        row_format: how a row is stored (see :class:`~engramrt.family.RowFormat`);
            fp8 + ue8m0 (DeepSeek Engram) by default.

    Raises:
        CapacityError: the chosen memory or disk is too small.
        ValidationError: inconsistent sizes, a shard of another rank.
    """
    placement = check_placement(placement, "make_store(TablePlacement('host', 'cpu'), packed=rows)")
    if packed is not None:
        num_rows, E = _check_packed(packed, num_rows, E, row_format)
    if shard is not None:
        placement.check_shard(shard)
        if num_rows is not None and num_rows != shard.num_rows:
            raise ValidationError(
                f"num_rows = {num_rows} but the shard holds rows [{shard.row_begin}, "
                f"{shard.row_end}) ({shard.num_rows} rows)"
            )
        num_rows = shard.num_rows
    elif placement.tp != 1:
        raise ValidationError(
            f"shard = None with a placement of rank {placement.rank} of tp={placement.tp}; "
            f"expected shard=placement.shard(layout, layer_index)"
        )
    if E is None:
        raise ValidationError("E = None; expected the values per row (or packed rows)")
    row_bytes = row_bytes_of(row_format, E)
    nbytes = None if num_rows is None else num_rows * row_bytes
    options = placement.tier_options(nbytes, path)
    store = tier_class(options.tier).build(
        num_rows,
        E,
        options,
        path=path,
        new_file=packed is not None if new_file is None else new_file,
        device=placement.compute_device,
        row_begin=0 if shard is None else shard.row_begin,
        col_begin=0 if shard is None else shard.col_begin,
        col_end=None if shard is None else shard.col_end,
        row_format=row_format,
    )
    if packed is not None:
        store.write_rows(0, packed)
        store.flush()
    return store
