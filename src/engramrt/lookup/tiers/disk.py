"""Disk tier: a raw packed-row file, memory-mapped and served by host gather.

The file is nothing but the packed rows back to back (``num_rows *
(E + E/32)`` bytes, no header), opened with ``numpy.memmap``; lookups run
the host-gather path of :mod:`.host_gather` over the mapping, so only the
pages holding the requested rows are read and a table larger than host
memory still serves (the operating system's page cache keeps hot rows).
Gather threads fault pages in parallel, which keeps several reads in
flight on an NVMe drive. Sorted unique ids read the file front to back.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from engramrt.errors import CheckpointError, ValidationError
from engramrt.lookup.reference import row_bytes_for
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.host_gather import DEFAULT_CHUNK_ROWS, HostGatherRowStore

__all__ = ["DiskRowStore"]


class DiskRowStore(HostGatherRowStore):
    """Packed rows in a raw file on disk, gathered through a memory map.

    Args:
        path: the packed-row file.
        num_rows: rows in the file; ``None`` reads it from the file size
            (only when opening an existing file).
        E: values per row.
        create: make a new file of ``num_rows`` rows (replacing any file at
            ``path``) after checking the free disk space; otherwise open an
            existing one, whose size must be ``num_rows * (E + E/32)``.
        writable: open an existing file for :meth:`write_rows` too.
        device, row_begin, col_begin, col_end, validate, chunk_rows,
        num_threads, backend: see :class:`HostGatherRowStore`.

    Raises:
        CapacityError: ``create=True`` and the file system has less free
            space than the file needs.
        CheckpointError: the file is missing or its size does not match.
    """

    tier = "disk"
    _maps_rows_for_gpu = False  # pinning a file's mapping would hold all of it in memory

    def __init__(
        self,
        path: str | os.PathLike[str],
        num_rows: int | None,
        E: int,
        *,
        create: bool = False,
        writable: bool = False,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        num_threads: int | None = None,
        backend: str = "auto",
    ) -> None:
        self.path = Path(path)
        self.create = create
        self.writable = writable or create
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
        self._memmap: np.memmap | None = None
        super().__init__(
            num_rows,
            E,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
            chunk_rows=chunk_rows,
            num_threads=num_threads,
            backend=backend,
        )

    def _allocate_source(self) -> torch.Tensor:
        shape = (self.num_rows, self.row_bytes)
        if self.create:
            existing = self.path.stat().st_size if self.path.is_file() else 0
            what = f"tier='disk' file {self.path} ({self.num_rows} rows of {self.row_bytes} B)"
            memory.require(
                what, self.nbytes - existing, memory.disk_free_bytes(self.path), "its file system"
            )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as handle:  # sparse until written
                handle.truncate(self.nbytes)
        if self.nbytes == 0:  # mmap cannot map zero bytes
            return torch.empty(shape, dtype=torch.uint8)
        if self.writable:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=shape)
        else:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r", shape=shape)
        with warnings.catch_warnings():
            # A read-only mapping is not writable; this tier never writes through it then.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self._memmap)

    def _write(self, start: int, packed: torch.Tensor) -> None:
        if not self.writable:
            raise ValidationError(
                f"write_rows on {self.path} opened read-only; expected writable=True or create=True"
            )
        super()._write(start, packed)

    def flush(self) -> None:
        """Write dirty pages of the mapping back to the file."""
        if self._memmap is not None:
            self._memmap.flush()
