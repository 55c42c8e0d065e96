"""Host memory that holds a store's packed rows, and who owns it.

The UVA, host and disk tiers keep their rows ``[num_rows, row_bytes]``
uint8 in host memory; where that memory comes from is injected as a
:class:`HostRows`:

- :class:`PrivateHostRows` (the default): the store's own allocation,
  exactly ``num_rows * row_bytes`` bytes after a capacity check, page-locked
  with ``cudaHostRegister`` when the device reads it (PyTorch's pinned
  allocator would round a 94 GiB table up to 128 GiB);
- :class:`MappedFileRows`: a raw packed-row file, memory-mapped (the disk
  tier);
- rows that already exist in a mapping several processes share
  (:class:`engramrt.distributed.stores.SharedRows`).
"""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from engramrt import memory
from engramrt.errors import CapacityError, ValidationError, os_error

__all__ = ["HostRows", "MappedFileRows", "PrivateHostRows"]


class HostRows(ABC):
    """Where a store's host rows live; the store asks for them once, when it is built.

    Attributes:
        writable: whether :meth:`check_writable` lets the store write rows.
        map_by_default: whether a host-tier store with ``gpu_reads=None``
            maps these rows for the GPU (not a file: pinning its mapping
            would hold all of it in memory).
    """

    writable: bool = True
    map_by_default: bool = True

    @abstractmethod
    def rows(self, num_rows: int, row_bytes: int, what: str) -> torch.Tensor:
        """Contiguous ``[num_rows, row_bytes]`` uint8 CPU rows (``what`` names the store
        in a capacity error)."""

    def map_for_device(self, rows: torch.Tensor, holder: object, what: str) -> None:
        """Page-lock ``rows`` and map them for every CUDA device while ``holder`` lives.

        Raises:
            CapacityError: the registration failed.
        """
        status = memory.cuda_host_register(holder, rows, read_only=not self.writable)
        if status != 0:
            raise CapacityError(
                f"{what} could not page-lock {memory.format_bytes(rows.numel())} of host memory: "
                f"cudaHostRegister returned cudaError {status} (is the memlock limit, ulimit -l, "
                f"below the table size?)"
            )

    def check_writable(self) -> None:
        """Raise :class:`ValidationError` unless the store may write these rows."""
        if not self.writable:
            raise ValidationError(f"write_rows on {self!r}; expected rows opened for writing")

    def flush(self) -> None:  # noqa: B027 - most owners hold memory: nothing to flush
        """Make written rows durable (a file); nothing to do for memory."""


class PrivateHostRows(HostRows):
    """A new allocation of exactly the rows' bytes, after a check of available memory."""

    def rows(self, num_rows: int, row_bytes: int, what: str) -> torch.Tensor:
        memory.require(what, num_rows * row_bytes, memory.host_available_bytes(), "host memory")
        return torch.empty((num_rows, row_bytes), dtype=torch.uint8)

    def __repr__(self) -> str:
        return "PrivateHostRows()"


class MappedFileRows(HostRows):
    """A raw packed-row file (rows back to back, no header), memory-mapped.

    Args:
        path: the file.
        create: make a new file of the rows' size (replacing any file at
            ``path``, sparse until written) after checking the free space.
        writable: map it for writing (implied by ``create``).
    """

    map_by_default = False

    def __init__(
        self, path: str | os.PathLike[str], *, create: bool = False, writable: bool = False
    ) -> None:
        self.path = Path(path)
        self.create = create
        self.writable = writable or create
        self._memmap: np.memmap | None = None

    def rows(self, num_rows: int, row_bytes: int, what: str) -> torch.Tensor:
        shape = (num_rows, row_bytes)
        nbytes = num_rows * row_bytes
        try:
            if self.create:
                existing = self.path.stat().st_size if self.path.is_file() else 0
                memory.require(
                    f"{what} file {self.path}",
                    nbytes - existing,
                    memory.disk_free_bytes(self.path),
                    "its file system",
                )
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "wb") as handle:  # sparse until written
                    handle.truncate(nbytes)
            if nbytes == 0:  # mmap cannot map zero bytes
                return torch.empty(shape, dtype=torch.uint8)
            if self.writable:
                self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=shape)
            else:
                self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r", shape=shape)
        except OSError as exc:
            # An unwritable, read-only or file-blocked directory: one line naming the file.
            action = "created" if self.create else "mapped"
            raise os_error(f"{what} file {str(self.path)!r} cannot be {action}", exc) from exc
        with warnings.catch_warnings():
            # A read-only mapping is not writable; the store never writes through it then.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self._memmap)

    def check_writable(self) -> None:
        if not self.writable:
            raise ValidationError(
                f"write_rows on {self.path} opened read-only; expected writable=True or create=True"
            )

    def flush(self) -> None:
        """Write dirty pages of the mapping back to the file."""
        if self._memmap is not None:
            self._memmap.flush()

    def __repr__(self) -> str:
        return f"MappedFileRows({str(self.path)!r}, writable={self.writable})"
