"""How the cache reads *packed* rows out of the tier behind it.

The :class:`~engramrt.lookup.tiers.RowStore` contract returns dequantised
bf16 rows, but the cache needs the packed 264-byte rows twice: to
dequantise the misses of a lookup into its output and to keep the
admitted ones. Fetching packed rows once serves both (one trip over PCIe
per missed row), and the dequantisation stays the lookup kernel's, so the
bytes equal the backing tier's own lookup.

A tier can offer ``gather_packed(local_ids) -> [U, row_bytes] uint8`` on
its compute device (local ids are ``row_id - row_begin``, int64); the
tiers of :mod:`engramrt.lookup.tiers` are read here through what they
already hold:

=========  ===============================================================
device     ``index_select`` on the table in device memory
uva        CPU ``index_select`` of the registered host table, then a copy
host/disk  the tier's own pipelined gather into pinned staging + bulk copy
=========  ===============================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engramrt.errors import ValidationError
from engramrt.lookup.tiers import DeviceRowStore, HostGatherRowStore, RowStore, UvaRowStore

__all__ = ["PackedRowReader", "packed_row_reader"]

PackedRowReader = Callable[[torch.Tensor], torch.Tensor]
"""``local_ids [U] int64`` (any device) -> ``[U, row_bytes]`` uint8 on the store's device."""


def packed_row_reader(store: RowStore) -> PackedRowReader:
    """A function that reads packed rows of ``store`` by local id.

    Raises:
        ValidationError: the store offers no packed rows (a tier that only
            returns bf16 rows cannot feed a cache).
    """
    gather_packed = getattr(store, "gather_packed", None)
    if callable(gather_packed):
        return gather_packed  # type: ignore[no-any-return]
    device = store.device
    if isinstance(store, DeviceRowStore):
        table = store.table

        def read_device(local_ids: torch.Tensor) -> torch.Tensor:
            return table.index_select(0, local_ids.to(device))

        return read_device
    if isinstance(store, UvaRowStore):
        host_table = store.host_table

        def read_uva(local_ids: torch.Tensor) -> torch.Tensor:
            rows = host_table.index_select(0, local_ids.cpu())
            return rows.to(device, non_blocking=False)

        return read_uva
    if isinstance(store, HostGatherRowStore):  # also DiskRowStore

        def read_host(local_ids: torch.Tensor) -> torch.Tensor:
            # The tier's tuned path: pinned staging, pieces overlapped with copies.
            return store._gather_to_device(local_ids.cpu())

        return read_host
    raise ValidationError(
        f"backing is {type(store).__name__} (tier={getattr(store, 'tier', '?')!r}), which offers "
        f"no packed rows; expected a device, uva, host or disk tier, or a store with "
        f"gather_packed(local_ids)"
    )
