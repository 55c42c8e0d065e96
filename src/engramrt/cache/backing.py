"""How the cache reads *stored* rows out of the tier behind it.

The :class:`~engramrt.lookup.tiers.RowStore` lookup returns dequantised
bf16 rows, but the cache needs the stored rows (264 bytes for an fp8 row of
``E = 256``, 320 for a bf16 row of ``d = 160``) twice: to serve the misses of
a lookup (dequantised into its output, or copied as they are) and to keep the
admitted ones. Fetching stored rows once serves both (one trip over PCIe
per missed row), and the dequantisation stays the lookup kernel's, so the
bytes equal the backing tier's own lookup. Every tier offers them through
:meth:`RowStore.gather_packed`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engramrt.lookup.tiers import RowStore

__all__ = ["PackedRowReader", "packed_row_reader"]

PackedRowReader = Callable[[torch.Tensor], torch.Tensor]
"""``local_ids [U] int64`` (any device) -> ``[U, row_bytes]`` uint8 on the store's device."""


def packed_row_reader(store: RowStore) -> PackedRowReader:
    """The function that reads stored rows of ``store`` by local id."""
    return store.gather_packed
