"""Storage tiers over rows that already live in host memory (a :class:`SharedHostTable`).

The tiers of :mod:`engramrt.lookup.tiers` allocate their own memory; these
subclasses serve an existing mapping instead, without copying it:

- :class:`SharedHostGatherRowStore`: the host-gather tier (CPU threads
  gather the unique rows, one bulk copy to the device) over any contiguous
  ``[num_rows, row_bytes]`` uint8 CPU tensor, through the tier's
  ``_allocate_source`` hook. Works on CPU-only machines (tests, gloo).
- :class:`SharedUvaRowStore`: the UVA tier (the lookup kernel reads the
  host rows over PCIe) over a shared table registered with
  ``cudaHostRegister`` by :meth:`SharedHostTable.register_cuda`, through
  the tier's ``_allocate_host_table`` hook.

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

from engramrt.config import EngramConfig, load_config
from engramrt.distributed.shared_table import Loader, SharedHostTable
from engramrt.errors import CapacityError, ValidationError
from engramrt.layout import EngramLayout
from engramrt.lookup.reference import row_bytes_for, row_width_for
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelSettings
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.base import RowStore
from engramrt.lookup.tiers.host_gather import DEFAULT_CHUNK_ROWS, GPU_SHARE, HostGatherRowStore
from engramrt.lookup.tiers.uva import UvaRowStore

__all__ = [
    "SHARED_TIERS",
    "SharedHostGatherRowStore",
    "SharedUvaRowStore",
    "checkpoint_fingerprint",
    "checkpoint_loader",
    "load_shared_table",
    "shared_store",
    "shared_table_name",
]

SHARED_TIERS: tuple[str, ...] = ("host", "uva")


def _check_rows(rows: torch.Tensor) -> int:
    """``E`` of contiguous uint8 ``rows [num_rows, E + E/32]`` in CPU memory."""
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dtype != torch.uint8
        or rows.dim() != 2
        or rows.device.type != "cpu"
        or not rows.is_contiguous()
    ):
        found = (
            f"{rows.dtype} {tuple(rows.shape)} on {rows.device} (contiguous: {rows.is_contiguous()})"
            if isinstance(rows, torch.Tensor)
            else type(rows).__name__
        )
        raise ValidationError(
            f"rows is {found}; expected contiguous CPU uint8 [num_rows, E + E/32]"
        )
    return row_width_for(rows.shape[1])


class SharedHostGatherRowStore(HostGatherRowStore):
    """The host-gather tier serving existing host rows, read-only.

    Args:
        rows: contiguous ``[num_rows, E + E/32]`` uint8 CPU tensor, e.g.
            ``SharedHostTable.rows`` or a row slice of it. Not copied.
        owner: an object to keep alive as long as the store (the table
            whose mapping ``rows`` views).
        device, row_begin, col_begin, col_end, validate, chunk_rows,
        num_threads, backend, gpu_reads, gpu_share: see
            :class:`HostGatherRowStore`; GPU reads of a shared table's rows
            register its whole mapping (:meth:`SharedHostTable.register_cuda`).
    """

    def __init__(
        self,
        rows: torch.Tensor,
        *,
        owner: object = None,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        num_threads: int | None = None,
        backend: str = "auto",
        gpu_reads: bool | None = None,
        gpu_share: float = GPU_SHARE,
    ) -> None:
        E = _check_rows(rows)
        self._existing_rows = rows
        self.owner = owner
        super().__init__(
            rows.shape[0],
            E,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            chunk_rows=chunk_rows,
            num_threads=num_threads,
            backend=backend,
            gpu_reads=gpu_reads,
            gpu_share=gpu_share,
        )

    def _allocate_source(self) -> torch.Tensor:
        return self._existing_rows  # no allocation, no capacity check: the rows exist

    def _register_source(self) -> None:
        if isinstance(self.owner, SharedHostTable):
            self.owner.register_cuda()  # the whole read-only mapping, once per process
            return
        status = memory.cuda_host_register(self, self.source, read_only=True)  # maybe PROT_READ
        if status != 0:
            raise CapacityError(
                f"cudaHostRegister of the shared rows ({memory.format_bytes(self.nbytes)}, "
                f"read-only) for GPU reads returned cudaError {status}; check ulimit -l (memlock)"
            )

    def _write(self, start: int, packed: torch.Tensor) -> None:
        raise ValidationError(
            "write_rows on a store over shared rows; expected them filled by the table's loader"
        )


class SharedUvaRowStore(UvaRowStore):
    """The UVA tier serving a shared table's rows (registered for CUDA, not copied).

    Args:
        table: the shared table; its rows (or ``rows_slice`` of them) are
            the store's rows.
        rows_slice: which rows of the table, a ``slice`` with step 1
            (default: all).
        device, row_begin, col_begin, col_end, validate, kernel: see
            :class:`UvaRowStore`.

    Raises:
        CapacityError: no CUDA device, or registration failed.
    """

    def __init__(
        self,
        table: SharedHostTable,
        *,
        rows_slice: slice | None = None,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
        kernel: LookupKernelSettings = DEFAULT_KERNEL,
    ) -> None:
        self.table = table
        rows = table.rows if rows_slice is None else table.rows[rows_slice]
        E = _check_rows(rows)
        self._existing_rows = rows
        super().__init__(
            rows.shape[0],
            E,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            kernel=kernel,
        )

    def _allocate_host_table(self) -> torch.Tensor:
        self.table.register_cuda()  # the whole mapping, once per process
        return self._existing_rows

    def _write(self, start: int, packed: torch.Tensor) -> None:
        raise ValidationError(
            "write_rows on a store over shared rows; expected them filled by the table's loader"
        )


def shared_store(
    table: SharedHostTable,
    tier: str = "host",
    *,
    rows_slice: slice | None = None,
    device: torch.device | str | None = None,
    row_begin: int = 0,
    col_begin: int = 0,
    col_end: int | None = None,
    **options: Any,
) -> RowStore:
    """A :class:`RowStore` of ``tier`` (``"host"`` or ``"uva"``) over ``table``'s rows, not copied.

    ``row_begin``/``col_begin``/``col_end`` give the shard the rows are
    (see :class:`RowStore`); ``options`` go to the tier (``backend``,
    ``chunk_rows``, ``num_threads``, ``validate``, kernel settings).
    """
    geometry: dict[str, Any] = {
        "device": device,
        "row_begin": row_begin,
        "col_begin": col_begin,
        "col_end": col_end,
    }
    if tier == "host":
        rows = table.rows if rows_slice is None else table.rows[rows_slice]
        return SharedHostGatherRowStore(rows, owner=table, **geometry, **options)
    if tier == "uva":
        return SharedUvaRowStore(table, rows_slice=rows_slice, **geometry, **options)
    raise ValidationError(
        f"tier={tier!r}; expected one of {', '.join(SHARED_TIERS)} for a shared host table "
        f"(tier 'device' copies into device memory: use make_store('device', packed=table.rows))"
    )


# --- checkpoints -------------------------------------------------------------------


def checkpoint_fingerprint(
    checkpoint: str | os.PathLike[str],
    config: EngramConfig,
    layer_index: int,
    tp: int,
    rank: int,
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
        "tp": tp,
        "rank": rank,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def shared_table_name(
    fingerprint: str, config: EngramConfig, layer_index: int, tp: int, rank: int
) -> str:
    """``engramrt-<fingerprint[:16]>-layer<id>-rank<r>-of-<tp>``: one file per layer and shard."""
    return f"engramrt-{fingerprint[:16]}-layer{config.layer_ids[layer_index]}-rank{rank}-of-{tp}"


def checkpoint_loader(
    checkpoint: str | os.PathLike[str],
    config: EngramConfig | str,
    layer_index: int,
    *,
    tp: int = 1,
    rank: int = 0,
    names: Any = None,
    block_rows: int | None = None,
    layout: EngramLayout | None = None,
) -> Loader:
    """A :data:`Loader` streaming rank ``rank``'s rows of layer ``layer_index`` from a
    checkpoint (:func:`engramrt.checkpoint.iter_packed_rows`), block by block."""

    def load(target: torch.Tensor) -> None:
        from engramrt.checkpoint import iter_packed_rows  # imports safetensors

        for local_row, packed in iter_packed_rows(
            checkpoint,
            config,
            layer_index,
            tp=tp,
            rank=rank,
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
    *,
    tp: int = 1,
    rank: int = 0,
    tier: str = "host",
    group: Any = None,
    directory: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
    names: Any = None,
    block_rows: int | None = None,
    timeout_s: float = 3600.0,
    **store_options: Any,
) -> RowStore:
    """Rank ``rank``'s shard of layer ``layer_index``, one host copy per node, as a store.

    Every data-parallel replica's TP rank ``rank`` maps the same file; the
    first process to take its creation lock reads the checkpoint. Pass the
    same ``group`` (e.g. the world of a one-node job) on every process
    calling this for the same layer.
    """
    cfg = load_config(config)
    layout = EngramLayout(cfg)
    shard = layout.column_shard(layer_index, tp, rank)
    fingerprint = checkpoint_fingerprint(checkpoint, cfg, layer_index, tp, rank)
    table = SharedHostTable.create_or_attach(
        shared_table_name(fingerprint, cfg, layer_index, tp, rank),
        shard.num_rows,
        row_bytes_for(cfg.head_dim),
        checkpoint_loader(
            checkpoint,
            cfg,
            layer_index,
            tp=tp,
            rank=rank,
            names=names,
            block_rows=block_rows,
            layout=layout,
        ),
        directory=directory,
        group=group,
        fingerprint=fingerprint,
        timeout_s=timeout_s,
    )
    return shared_store(
        table,
        tier,
        device=device,
        row_begin=shard.row_begin,
        col_begin=shard.col_begin,
        col_end=shard.col_end,
        **store_options,
    )
