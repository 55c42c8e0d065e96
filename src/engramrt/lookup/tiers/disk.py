"""Disk tier: a raw packed-row file, memory-mapped and served by host gather.

The file is nothing but the stored rows back to back (``num_rows * row_bytes``
bytes, no header: ``E + E/32`` per fp8 row, ``2 * E`` per bf16 row), opened
with ``numpy.memmap``
(:class:`~engramrt.lookup.tiers.host_rows.MappedFileRows`); lookups run the
host-gather path of :mod:`.host_gather` over the mapping, so only the pages
holding the requested rows are read and a table larger than host memory
still serves (the operating system's page cache keeps hot rows). Gather
threads fault pages in parallel, which keeps several reads in flight on an
NVMe drive. Sorted unique ids read the file front to back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engramrt.errors import CheckpointError, ValidationError
from engramrt.family import FP8_UE8M0, RowFormat
from engramrt.lookup.tiers.base import RowStore, register_tier, row_bytes_of
from engramrt.lookup.tiers.host_gather import HostGatherRowStore, HostOptions
from engramrt.lookup.tiers.host_rows import HostRows, MappedFileRows

__all__ = ["DiskOptions", "DiskRowStore"]


@dataclass(frozen=True)
class DiskOptions(HostOptions):
    """Settings of tier ``"disk"``: those of :class:`HostOptions` (GPU reads stay
    off unless ``gpu_reads=True``: pinning a file's mapping would hold all of it in
    memory), and

    Attributes:
        writable: open an existing file for :meth:`RowStore.write_rows` too
            (a file the store creates is always writable).
    """

    tier = "disk"
    writable: bool = False


@register_tier
class DiskRowStore(HostGatherRowStore):
    """Stored rows in a raw file on disk, gathered through a memory map.

    Args:
        path: the packed-row file.
        num_rows: rows in the file; ``None`` reads it from the file size
            (only when opening an existing file).
        E: values per row.
        options: :class:`DiskOptions`.
        create: make a new file of ``num_rows`` rows (replacing any file at
            ``path``) after checking the free disk space; otherwise open an
            existing one, whose size must be ``num_rows * row_bytes``.
        device, row_begin, col_begin, col_end, row_format: see :class:`RowStore`.

    Raises:
        CapacityError: ``create=True`` and the file system has less free
            space than the file needs.
        CheckpointError: the file is missing or its size does not match.
    """

    tier = "disk"
    options_type = DiskOptions
    takes_host_rows = False  # it maps its own file

    def __init__(
        self,
        path: str | os.PathLike[str],
        num_rows: int | None,
        E: int,
        options: DiskOptions | None = None,
        *,
        create: bool = False,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        row_format: RowFormat = FP8_UE8M0,
    ) -> None:
        options = DiskOptions() if options is None else options
        writable = options.writable if isinstance(options, DiskOptions) else False
        self.path = Path(path)
        row_bytes = row_bytes_of(row_format, E)
        rows = row_format.describe(E)
        if not create:
            if not self.path.is_file():
                raise CheckpointError(
                    f"path = {str(self.path)!r} is not a file; expected a packed-row file"
                )
            size = self.path.stat().st_size
            if num_rows is None:
                if size % row_bytes != 0:
                    raise CheckpointError(
                        f"{self.path} has {size} bytes; expected a multiple of the {row_bytes}-byte "
                        f"rows ({rows})"
                    )
                num_rows = size // row_bytes
            elif size != num_rows * row_bytes:
                raise CheckpointError(
                    f"{self.path} has {size} bytes; expected {num_rows} rows x {row_bytes} B = "
                    f"{num_rows * row_bytes} bytes ({rows})"
                )
        elif num_rows is None:
            raise ValidationError(
                "num_rows = None with create=True; expected the rows of the new file"
            )
        self.create = create
        self.writable = writable or create
        self._file_rows = MappedFileRows(self.path, create=create, writable=writable)
        super().__init__(
            num_rows,
            E,
            options,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            row_format=row_format,
        )

    def _own_host_rows(self) -> HostRows:
        return self._file_rows

    @classmethod
    def _build(
        cls,
        num_rows: int | None,
        E: int,
        options: Any,
        path: Any,
        new_file: bool,
        shard: dict[str, Any],
    ) -> RowStore:
        """The file at ``path``: created (``new_file``) or opened."""
        if path is None:
            raise ValidationError("path = None; expected the packed-row file of tier='disk'")
        return cls(path, num_rows, E, options, create=new_file, **shard)
