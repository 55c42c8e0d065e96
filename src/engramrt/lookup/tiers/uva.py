"""UVA tier: pinned host memory read directly by the lookup kernel.

The table is ordinary host memory registered with CUDA
(``cudaHostRegister``, portable + mapped) so the GPU can read it over PCIe
through unified virtual addressing; the same gather + dequantise kernel as
the device tier then runs unchanged, each row crossing the bus once. No
host synchronisation, so it can be captured in a CUDA graph, but every
lookup is a small random PCIe read: measured at 26 M rows/s (73 M rows/s
with ids sorted first) against the host-gather tier's bulk copies, so
``make_store(tier="auto")`` never picks it.

Triton refuses pointers it cannot map to the device; it resolves a
pointer argument with ``cuPointerGetAttribute(DEVICE_POINTER)``, which for
registered host memory returns its device address. So the kernel receives
an object whose ``data_ptr()`` is the host address and ``dtype`` is uint8.

Registration is done on pageable memory rather than through
``pin_memory=True`` because PyTorch's pinned-memory allocator rounds each
block up to a power of two (a 94 GiB table would take 128 GiB).
"""

from __future__ import annotations

import torch

from engramrt.errors import CapacityError
from engramrt.lookup.reference import word_dtype_for
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelSettings, check_kernel_settings
from engramrt.lookup.tiers import memory
from engramrt.lookup.tiers.base import RowStore

__all__ = ["MappedHostRows", "UvaRowStore", "gather_mapped_rows", "lookup_mapped_rows"]


class MappedHostRows:
    """What Triton needs of a pointer argument: ``data_ptr()`` and ``dtype``.

    ``host_pointer`` is registered host memory (see the module doc);
    ``dtype`` the element type the kernel reads it as.
    """

    def __init__(self, host_pointer: int, dtype: torch.dtype = torch.uint8) -> None:
        self._host_pointer = host_pointer
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._host_pointer


class UvaRowStore(RowStore):
    """Packed rows in page-locked host memory, read by the kernel over PCIe.

    Args:
        num_rows, E, device, row_begin, col_begin, col_end, validate: see
            :class:`RowStore`; ``device`` must be a CUDA device.
        kernel: the lookup kernel's settings (see :class:`LookupKernelSettings`),
            the attribute :attr:`kernel` read at every lookup.

    Raises:
        CapacityError: no CUDA device, or less available host memory than
            the table needs, or the registration failed.
    """

    tier = "uva"

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = False,
        kernel: LookupKernelSettings = DEFAULT_KERNEL,
    ) -> None:
        super().__init__(
            num_rows,
            E,
            device=device,
            row_begin=row_begin,
            col_begin=col_begin,
            col_end=col_end,
            validate=validate,
        )
        memory.require_cuda_mapping(
            "tier='uva'", self.device, "; use tier='host' or tier='device' on this machine"
        )
        self.kernel = check_kernel_settings(kernel)
        self.host_table = self._allocate_host_table()
        self._mapped = MappedHostRows(self.host_table.data_ptr())
        self._mapped_words = MappedHostRows(
            self.host_table.data_ptr(), word_dtype_for(self.row_bytes)
        )

    def _allocate_host_table(self) -> torch.Tensor:
        """``[num_rows, row_bytes]`` uint8 host rows, page-locked and mapped for the device.

        A hook: a store over memory that already exists (a table shared by
        several processes) overrides it and checks no capacity.
        """
        what = f"tier='uva' ({self.num_rows} rows of {self.row_bytes} B, page-locked)"
        memory.require(what, self.nbytes, memory.host_available_bytes(), "host memory")
        host_table = torch.empty((self.num_rows, self.row_bytes), dtype=torch.uint8)
        if self.nbytes > 0:
            status = memory.cuda_host_register(self, host_table)
            if status != 0:
                raise CapacityError(
                    f"tier='uva' could not page-lock {memory.format_bytes(self.nbytes)} of host "
                    f"memory: cudaHostRegister returned cudaError {status} (is the memlock "
                    f"limit, ulimit -l, below the table size?)"
                )
        return host_table

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.host_table[start : start + packed.shape[0]].copy_(packed)

    def device_rows(self) -> MappedHostRows:
        return self._mapped

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows read by the device from host memory (no host synchronisation)."""
        return gather_mapped_rows(local_ids, self._mapped_words, self.row_bytes, self.device)

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        return lookup_mapped_rows(
            row_ids,
            self._mapped,
            out,
            E=self.E,
            device=self.device,
            col_begin=self.col_begin,
            col_end=col_end,
            row_begin=self.row_begin,
            kernel=self.kernel,
        )


def lookup_mapped_rows(
    row_ids: torch.Tensor,
    mapped: MappedHostRows,
    out: torch.Tensor | None,
    *,
    E: int,
    device: torch.device,
    col_begin: int,
    col_end: int,
    row_begin: int,
    kernel: LookupKernelSettings = DEFAULT_KERNEL,
) -> torch.Tensor:
    """The lookup kernel over rows in registered host memory (``mapped``, bytes)."""
    from engramrt.lookup.kernel import lookup_rows_triton  # imports Triton

    row_ids = row_ids.to(device, non_blocking=True)
    if out is None:
        out = torch.empty((*row_ids.shape, E), dtype=torch.bfloat16, device=device)
    with torch.cuda.device(device):
        return lookup_rows_triton(
            row_ids,
            mapped,
            out,
            E=E,
            col_begin=col_begin,
            col_end=col_end,
            row_begin=row_begin,
            kernel=kernel,
        )


def gather_mapped_rows(
    row_ids: torch.Tensor,
    mapped_words: MappedHostRows,
    row_bytes: int,
    device: torch.device,
    *,
    row_begin: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed rows ``[U, row_bytes]`` of ids ``[U]`` copied by the device out of registered
    host memory (``mapped_words``, viewed as :func:`word_dtype_for` words)."""
    from engramrt.lookup.kernel import gather_packed_rows_triton  # imports Triton

    row_ids = row_ids.to(device, non_blocking=True)
    if out is None:
        out = torch.empty((row_ids.shape[0], row_bytes), dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        return gather_packed_rows_triton(row_ids, mapped_words, out, row_begin=row_begin)
