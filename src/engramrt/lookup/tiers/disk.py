"""Disk tier: a raw packed-row file, memory-mapped and served by host gather.

The file is nothing but the packed rows back to back (``num_rows *
(E + E/32)`` bytes, no header), opened with ``numpy.memmap``
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
from engramrt.lookup.tiers.base import RowStore, register_tier
from engramrt.lookup.tiers.host_gather import HostGatherRowStore, HostOptions
from engramrt.lookup.tiers.host_rows import HostRows, MappedFileRows
from engramrt.packed import row_bytes_for

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
    """Packed rows in a raw file on disk, gathered through a memory map.

    Args:
        path: the packed-row file.
        num_rows: rows in the file; ``None`` reads it from the file size
            (only when opening an existing file).
        E: values per row.
        options: :class:`DiskOptions`.
        create: make a new file of ``num_rows`` rows (replacing any file at
            ``path``) after checking the free disk space; otherwise open an
            existing one, whose size must be ``num_rows * (E + E/32)``.
        device, row_begin, col_begin, col_end: see :class:`RowStore`.

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
    ) -> None:
        options = DiskOptions() if options is None else options
        writable = options.writable if isinstance(options, DiskOptions) else False
        self.path = Path(path)
        row_bytes = row_bytes_for(E)
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
                        f"rows of E={E}"
                    )
                num_rows = size // row_bytes
            elif size != num_rows * row_bytes:
                raise CheckpointError(
                    f"{self.path} has {size} bytes; expected {num_rows} rows x {row_bytes} B = "
                    f"{num_rows * row_bytes} bytes"
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
