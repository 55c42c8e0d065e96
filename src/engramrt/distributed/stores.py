"""Storage tiers over rows that already live in host memory (a :class:`SharedHostTable`).

The host-memory tiers of :mod:`engramrt.lookup.tiers` take their rows from
an injected :class:`~engramrt.lookup.tiers.host_rows.HostRows`; here that is
:class:`SharedRows`, an existing mapping served without copying it:

- tier ``"host"``: CPU threads gather the unique rows, one bulk copy to
  the device; works on CPU-only machines (tests, gloo);
- tier ``"uva"``: the lookup kernel reads the host rows over PCIe, the
  table registered with ``cudaHostRegister`` by
  :meth:`SharedHostTable.register_cuda`.

:func:`shared_store` builds either (any registered tier that takes
``host_rows``), placed by a :class:`~engramrt.lookup.tiers.TablePlacement`.

:func:`load_shared_table` is the one call an engine makes per layer:
this rank's shard of a checkpoint's table, loaded once per node, served by
one of these stores.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from engramrt import memory
from engramrt.config import EngramConfig, load_config
from engramrt.distributed.shared_table import Loader, SharedHostTable
from engramrt.errors import CapacityError, ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.lookup.tiers import (
    TIERS,
    HostRows,
    RowStore,
    TablePlacement,
    check_placement,
    tier_class,
)
from engramrt.packed import check_packed_rows, row_bytes_for

SHARED_PLACEMENT = TablePlacement("host")
"""The default placement of a shared table: tier ``"host"`` on the default device."""

__all__ = [
    "SharedRows",
    "checkpoint_fingerprint",
    "checkpoint_loader",
    "load_shared_table",
    "shared_store",
    "shared_table_name",
    "shared_tiers",
]


class SharedRows(HostRows):
    """Rows that already exist in host memory (a :class:`SharedHostTable`'s mapping, or a
    row slice of it), served read-only and never copied.

    Args:
        rows: contiguous ``[num_rows, E + E/32]`` uint8 CPU tensor.
        owner: kept alive as long as the store (the table whose mapping
            ``rows`` views); a :class:`SharedHostTable` registers its whole
            mapping for the device once per process
            (:meth:`SharedHostTable.register_cuda`).
    """

    writable = False

    def __init__(self, rows: torch.Tensor, owner: object = None) -> None:
        self.E = check_packed_rows("rows", rows, on_cpu=True)
        self._rows = rows
        self.owner = owner

    def rows(self, num_rows: int, row_bytes: int, what: str) -> torch.Tensor:
        if tuple(self._rows.shape) != (num_rows, row_bytes):
            raise ValidationError(
                f"{what}: shared rows are {tuple(self._rows.shape)}; expected "
                f"({num_rows}, {row_bytes})"
            )
        return self._rows  # no allocation, no capacity check: the rows exist

    def map_for_device(self, rows: torch.Tensor, holder: object, what: str) -> None:
        if isinstance(self.owner, SharedHostTable):
            self.owner.register_cuda()  # the whole read-only mapping, once per process
            return
        status = memory.cuda_host_register(holder, rows, read_only=True)  # maybe PROT_READ
        if status != 0:
            raise CapacityError(
                f"cudaHostRegister of the shared rows ({memory.format_bytes(rows.numel())}, "
                f"read-only) for GPU reads returned cudaError {status}; check ulimit -l (memlock)"
            )

    def check_writable(self) -> None:
        raise ValidationError(
            "write_rows on a store over shared rows; expected them filled by the table's loader"
        )

    def __repr__(self) -> str:
        return f"SharedRows({tuple(self._rows.shape)}, owner={type(self.owner).__name__})"


def shared_tiers() -> tuple[str, ...]:
    """The registered tiers that can serve rows they do not allocate (``host_rows``)."""
    return tuple(sorted(name for name, cls in TIERS.items() if cls.takes_host_rows))


def shared_store(
    table: SharedHostTable | torch.Tensor,
    placement: TablePlacement = SHARED_PLACEMENT,
    *,
    rows_slice: slice | None = None,
    shard: ColumnShard | None = None,
) -> RowStore:
    """A :class:`RowStore` over ``table``'s rows, not copied, placed by ``placement``
    (tier ``"host"`` or ``"uva"``, with its settings, and the device).

    ``table`` is a :class:`SharedHostTable` or any contiguous CPU uint8 rows
    ``[num_rows, E + E/32]``; ``rows_slice`` (a step-1 ``slice``) takes some
    of them. ``shard``: the rows and hash columns they are (one of the
    placement's rank, see :meth:`TablePlacement.shard`); None: rows from 0,
    every column.
    """
    placement = check_placement(placement, "shared_store(table, TablePlacement('host', 'cpu'))")
    name = placement.tier_name
    if name not in shared_tiers():
        raise ValidationError(
            f"tier={name!r}; expected one of {', '.join(shared_tiers())} for a shared host table "
            f"(tier 'device' copies into device memory: use make_store(TablePlacement('device'), "
            f"packed=table.rows))"
        )
    rows = table.rows if isinstance(table, SharedHostTable) else table
    if rows_slice is not None:
        rows = rows[rows_slice]
    host_rows = SharedRows(rows, owner=table)
    if shard is not None:
        placement.check_shard(shard)
        if shard.num_rows != rows.shape[0]:
            raise ValidationError(
                f"shard holds {shard.num_rows} rows; expected the table's {rows.shape[0]}"
            )
    cls = tier_class(name)
    store: RowStore = cls(
        rows.shape[0],
        host_rows.E,
        placement.tier_options(rows.numel()),
        host_rows=host_rows,
        device=placement.compute_device,
        row_begin=0 if shard is None else shard.row_begin,
        col_begin=0 if shard is None else shard.col_begin,
        col_end=None if shard is None else shard.col_end,
    )
    return store


# --- checkpoints -------------------------------------------------------------------


def checkpoint_fingerprint(
    checkpoint: str | os.PathLike[str],
    config: EngramConfig,
    layer_index: int,
    shard: ColumnShard,
) -> str:
    """What a shard's rows are made of: the checkpoint's files (path, size, mtime), the
    table geometry and the shard. Two processes agree on it iff they load the same rows."""
    path = Path(checkpoint).resolve()
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors*"))
    described = {
        "checkpoint": str(path),
        "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "layer_id": config.layer_ids[layer_index],
        "num_embeddings": config.num_embeddings[layer_index],
        "head_dim": config.head_dim,
        "tp": shard.tp,
        "rank": shard.rank,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def shared_table_name(
    fingerprint: str, config: EngramConfig, layer_index: int, shard: ColumnShard
) -> str:
    """``engramrt-<fingerprint[:16]>-layer<id>-rank<r>-of-<tp>``: one file per layer and shard."""
    layer_id = config.layer_ids[layer_index]
    return f"engramrt-{fingerprint[:16]}-layer{layer_id}-rank{shard.rank}-of-{shard.tp}"


def checkpoint_loader(
    checkpoint: str | os.PathLike[str],
    config: EngramConfig | str,
    layer_index: int,
    shard: ColumnShard,
    *,
    names: Any = None,
    block_rows: int | None = None,
    layout: EngramLayout | None = None,
) -> Loader:
    """A :data:`Loader` streaming ``shard``'s rows of layer ``layer_index`` from a
    checkpoint (:func:`engramrt.checkpoint.iter_packed_rows`), block by block."""

    def load(target: torch.Tensor) -> None:
        from engramrt.checkpoint import iter_packed_rows  # imports safetensors

        for local_row, packed in iter_packed_rows(
            checkpoint,
            config,
            layer_index,
            shard=shard,
            names=names,
            block_rows=block_rows,
            layout=layout,
        ):
            target[local_row : local_row + packed.shape[0]].copy_(packed)

    return load


def load_shared_table(
    checkpoint: str | os.PathLike[str],
    config: EngramConfig | str,
    layer_index: int,
    placement: TablePlacement = SHARED_PLACEMENT,
    *,
    group: Any = None,
    directory: str | os.PathLike[str] | None = None,
    names: Any = None,
    block_rows: int | None = None,
    timeout_s: float = 3600.0,
) -> RowStore:
    """The placement's rank's shard of layer ``layer_index``, one host copy per node, as a
    store (tier ``"host"`` or ``"uva"``, see :func:`shared_store`).

    Every data-parallel replica's TP rank maps the same file; the first
    process to take its creation lock reads the checkpoint. Pass the same
    ``group`` (e.g. the world of a one-node job) on every process calling
    this for the same layer.
    """
    placement = check_placement(
        placement, "load_shared_table(checkpoint, config, 0, TablePlacement('host', tp=2, rank=1))"
    )
    cfg = load_config(config)
    layout = EngramLayout(cfg)
    shard = placement.shard(layout, layer_index)
    fingerprint = checkpoint_fingerprint(checkpoint, cfg, layer_index, shard)
    table = SharedHostTable.create_or_attach(
        shared_table_name(fingerprint, cfg, layer_index, shard),
        shard.num_rows,
        row_bytes_for(cfg.head_dim),
        checkpoint_loader(
            checkpoint, cfg, layer_index, shard, names=names, block_rows=block_rows, layout=layout
        ),
        directory=directory,
        group=group,
        fingerprint=fingerprint,
        timeout_s=timeout_s,
    )
    return shared_store(table, placement, shard=shard)
