"""Stream blocks of rows into a :class:`~engramrt.lookup.tiers.RowStore`: the one write loop
of every table loader (DeepSeek Engram's packed fp8 rows, Qwen4-Exp PLE's bf16 rows)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from engramrt.lookup.tiers import RowStore

__all__ = ["fill_store"]


def fill_store(
    store: RowStore,
    blocks: Iterable[tuple[int, torch.Tensor]],
    *,
    on_rows: Callable[[int], None] | None = None,
) -> int:
    """Write ``(local_row, rows [n, w])`` blocks into ``store`` as they arrive; returns the
    rows written.

    ``rows`` are the stored rows themselves: packed uint8 (``E + E/32`` bytes of an fp8 row)
    or values whose bytes are the row (bf16 ``[n, d]``, viewed as ``[n, 2 d]`` uint8): the
    bytes go into the store bit for bit, nothing is converted. Memory peaks at the store
    plus the block in hand. ``on_rows`` is called with ``n`` after each block (progress).
    """
    written = 0
    for local_row, rows in blocks:
        packed = rows if rows.dtype == torch.uint8 else rows.contiguous().view(torch.uint8)
        store.write_rows(local_row, packed)
        written += rows.shape[0]
        if on_rows is not None:
            on_rows(rows.shape[0])
    return written
