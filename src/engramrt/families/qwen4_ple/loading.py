"""Load Qwen4-Exp PLE tables into storage tiers: one bf16 :class:`RowStore` per PLE layer,
holding a tensor-parallel rank's values of every row.

The same loader serves the model's own checkpoint (the table as ``split_ngram_parts`` row
shards ``...ngram_embedding.shard_<k>.weight`` or whole, one file or a directory with or
without an HF index; :mod:`engramrt.families.qwen4_ple.checkpoint`) and the per-rank files
``engramrt convert`` writes for Qwen4-Exp (:mod:`engramrt.families.qwen4_ple.converted`).
Under the TP plan ``embedding_colwise`` a rank owns values ``[rank * w, (rank + 1) * w)``
of every row (``w = ceil(d / tp)``, :meth:`PleTableRegion.width_shard`); its store holds
``R`` rows of ``w`` bf16 values (``2 w`` bytes each), the row id being the table row.

Every table is checked before a store is made or a row read (names, shapes, dtype, hash
buffers; for converted files the family, fingerprint and value ranges), then the rows
stream in blocks of about ``DEFAULT_BLOCK_BYTES`` into the store through
:func:`engramrt.checkpoint.fill.fill_store` (bf16 values viewed as bytes, bit for bit):
memory peaks at the stores plus one block. The ranks of ``group`` first agree on the
conversion they read (:func:`engramrt.checkpoint.ranks.agreed_checkpoint`), as the Engram
loaders' ranks do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engramrt.checkpoint.fill import fill_store
from engramrt.checkpoint.ranks import agreed_checkpoint
from engramrt.checkpoint.reader import SafetensorsCheckpoint
from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.converted import (
    PleRankRead,
    iter_ple_rank_blocks,
    plan_ple_rank_read,
    ple_rank_region,
)
from engramrt.families.qwen4_ple.family import Qwen4PleFamily
from engramrt.family import BF16
from engramrt.layout import ColumnShard
from engramrt.lookup.tiers import RowStore, TablePlacement, check_placement, make_store

__all__ = ["load_ple_tables", "ple_disk_path", "ple_family"]

Checkpoint = SafetensorsCheckpoint | str | os.PathLike[str]
FamilySource = Qwen4PleFamily | PleConfig | Mapping[str, Any] | str | Path
"""The family, or what :class:`Qwen4PleFamily` is built from (a config, an HF config dict,
a ``config.json`` or a model directory)."""


def ple_family(config: FamilySource) -> Qwen4PleFamily:
    """``config`` as a :class:`Qwen4PleFamily` (PLE must be on)."""
    return config if isinstance(config, Qwen4PleFamily) else Qwen4PleFamily(config)


def ple_disk_path(placement: TablePlacement, layer_id: int) -> Path | None:
    """``<disk_dir>/ple-layer<id>-rank<r>-of-<tp>.rows``: where tier ``"disk"`` keeps PLE
    layer ``layer_id``'s rows (beside, never over, the Engram layers' files); None without
    a ``disk_dir``."""
    if placement.disk_dir is None:
        return None
    name = f"ple-layer{layer_id}-rank{placement.rank}-of-{placement.tp}.rows"
    return Path(placement.disk_dir) / name


def _store_for(read: PleRankRead, family: Qwen4PleFamily, placement: TablePlacement) -> RowStore:
    """An empty bf16 store of the read's region: every row (all hash columns), its values."""
    region = read.region
    shard = ColumnShard(
        rank=placement.rank,
        tp=placement.tp,
        col_begin=0,
        col_end=family.config.n_cols,
        row_begin=region.row_begin,
        row_end=region.row_end,
    )
    return make_store(
        placement,
        E=region.num_values,
        shard=shard,
        path=ple_disk_path(placement, read.layer_id),
        new_file=True,
        row_format=BF16,
    )


def load_ple_tables(
    checkpoint: Checkpoint,
    config: FamilySource,
    placement: TablePlacement | None = None,
    *,
    ple_indices: Sequence[int] | None = None,
    block_rows: int | None = None,
    prefix: str | None = None,
    verify_checksums: bool = False,
    group: Any = None,
    on_rows: Callable[[int], None] | None = None,
) -> list[RowStore]:
    """One bf16 store per PLE layer, holding the placement's rank's values of every row.

    Args:
        checkpoint: a ``.safetensors`` file, a directory of them (an HF index or not), or an
            open :class:`SafetensorsCheckpoint`: the model's checkpoint, or the files of
            ``engramrt convert`` for a Qwen4-Exp config (any ``--tp`` whose ranks' values
            cover this rank's).
        config: a :class:`Qwen4PleFamily`, or its config (:class:`PleConfig`, HF dict,
            ``config.json`` or model directory).
        placement: the tier (``"device"``, ``"uva"``, ``"host"``, ``"disk"`` or their
            options), the compute device, the rank of ``tp`` whose values are kept
            (:meth:`PleTableRegion.width_shard`) and, for ``"disk"``, the directory of the
            row files (:func:`ple_disk_path`); default ``TablePlacement()``.
        ple_indices: the PLE layers to load (positions in ``ple_layer_ids``, e.g. a pipeline
            stage's); default all.
        block_rows: rows per block (default: about ``DEFAULT_BLOCK_BYTES``).
        prefix: ``<P>`` of the model's names; None finds it (converted files name their
            tensors themselves).
        verify_checksums: first check the content digest of every file the rows come from
            (files engramrt wrote record one; each is read whole once).
        group: a ``torch.distributed`` group of the ranks loading this checkpoint: they
            compare conversion ids before reading and refuse to serve different ones. Every
            rank of the group must call this.
        on_rows: called with the rows of each block written (progress).

    Returns:
        The stores, in ``ple_indices`` order: ``store.num_rows`` is ``R``, ``store.E`` the
        rank's value count, ``store.gather_packed(ids).view(torch.bfloat16)`` the rows'
        values.

    Raises:
        CheckpointError: a table is missing, malformed, not bf16 or not finite; a converted
            file of another family or fingerprint, whose tensor disagrees with its metadata,
            or no file holding some of this rank's values (naming what and the expected).
        ValidationError: a ``tp`` that leaves a rank no value; ``ple_indices`` out of range.
        CapacityError: the chosen memory or disk is too small.
    """
    family = ple_family(config)
    placement = check_placement(
        placement, "load_ple_tables(path, config, TablePlacement('host', 'cpu', tp=2, rank=0))"
    )
    indices = _indices(family, ple_indices)
    regions = [ple_rank_region(family, index, placement.tp, placement.rank) for index in indices]
    with agreed_checkpoint(checkpoint, group) as ckpt:
        reads = [
            plan_ple_rank_read(ckpt, family, index, region, prefix=prefix)
            for index, region in zip(indices, regions, strict=True)
        ]
        if verify_checksums:
            for file in sorted({file for read in reads for file in read.files}):
                ckpt.verify(file)
        stores = [_store_for(read, family, placement) for read in reads]
        for read, store in zip(reads, stores, strict=True):
            fill_store(store, iter_ple_rank_blocks(read, block_rows=block_rows), on_rows=on_rows)
            store.flush()
    return stores


def _indices(family: Qwen4PleFamily, ple_indices: Sequence[int] | None) -> list[int]:
    count = family.config.n_layers
    if ple_indices is None:
        return list(range(count))
    indices = list(ple_indices)
    if (
        not indices
        or len(set(indices)) != len(indices)
        or not all(
            not isinstance(i, bool) and isinstance(i, int) and 0 <= i < count for i in indices
        )
    ):
        raise ValidationError(
            f"ple_indices={ple_indices!r}; expected distinct ints in [0, {count}) (positions in "
            f"ple_layer_ids={list(family.config.ple_layer_ids)})"
        )
    return indices
