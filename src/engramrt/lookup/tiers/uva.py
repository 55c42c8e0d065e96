"""UVA tier: pinned host memory read directly by the lookup kernel.

The table is host memory registered with CUDA (``cudaHostRegister``,
portable + mapped) so the GPU can read it over PCIe through unified virtual
addressing; the same gather + dequantise kernel as the device tier then
runs unchanged (:mod:`engramrt.lookup.mapped`), each row crossing the bus
once. No host synchronisation, so it can be captured in a CUDA graph, but
every lookup is a small random PCIe read, slower than the host-gather
tier's bulk copies (BENCHMARKS.md#what-keeping-the-tables-off-the-gpu-costs), so ``make_store(tier="auto")``
never picks it.

The rows come from a :class:`~engramrt.lookup.tiers.host_rows.HostRows`:
by default a private allocation of exactly the table's bytes, registered
after the fact, because PyTorch's pinned-memory allocator rounds each block
up to a power of two (a 94 GiB table would take 128 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engramrt import memory
from engramrt.lookup.mapped import MappedHostRows, gather_mapped_rows
from engramrt.lookup.settings import tuned_lookup_config
from engramrt.lookup.tiers.base import KernelRowStore, register_tier
from engramrt.lookup.tiers.options import KernelTierOptions
from engramrt.packed import word_dtype_for

__all__ = ["UVA_KERNEL", "UvaOptions", "UvaRowStore"]

UVA_KERNEL = tuned_lookup_config("uva")
"""The lookup kernel's settings on this tier, from the default ``lookup_rows`` file
(a store on a GPU with a file of its own takes that file's entry): a grid
bounded at about one program per SM, each serving small tiles in turn. Reads of
scattered rows over PCIe gain nothing from more requests in flight, only
queue longer. Chosen by measurement: BENCHMARKS.md#decode-against-the-targets-2026-12-01;
the bench's ``lookup/uva/T=256`` case times
:data:`engramrt.bench.cases_lookup.DECODE_READ_SWEEP` beside it."""


@dataclass(frozen=True)
class UvaOptions(KernelTierOptions):
    """Settings of tier ``"uva"``: the checks, ``kernel`` (default :data:`UVA_KERNEL`)
    and ``backend``, ``"auto"`` or ``"triton"`` (the GPU reads host memory with the
    Triton kernel only)."""

    tier = "uva"
    backends: ClassVar[tuple[str, ...]] = ("auto", "triton")


@register_tier
class UvaRowStore(KernelRowStore):
    """Packed rows in page-locked host memory, read by the kernel over PCIe.

    Args: see :class:`RowStore` (``device``: a CUDA device); options:
    :class:`UvaOptions`; ``host_rows``: where the rows live (default: a
    private allocation).

    Raises:
        CapacityError: no CUDA device, or less available host memory than
            the table needs, or the registration failed.
    """

    tier = "uva"
    options_type = UvaOptions
    takes_host_rows = True

    def _setup(self) -> None:
        super()._setup()
        memory.require_cuda_mapping(
            "tier='uva'", self.device, "; use tier='host' or tier='device' on this machine"
        )
        what = f"tier='uva' ({self.num_rows} rows of {self.row_bytes} B, page-locked)"
        self.host_table = self.host_rows.rows(self.num_rows, self.row_bytes, what)
        if self.nbytes > 0:
            self.host_rows.map_for_device(self.host_table, self, "tier='uva'")
        pointer = self.host_table.data_ptr()
        self._mapped = MappedHostRows(pointer, self.num_rows)
        self._mapped_words = self._mapped.view(word_dtype_for(self.row_bytes))

    @property
    def source(self) -> torch.Tensor:
        """The host rows ``[num_rows, row_bytes]`` uint8 (as the host tier names them)."""
        return self.host_table

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.host_rows.check_writable()
        memory.copy_into_host(self.host_table[start : start + packed.shape[0]], packed)

    def flush(self) -> None:
        self.host_rows.flush()

    def device_rows(self) -> MappedHostRows:
        return self._mapped

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows read by the device from host memory (no host synchronisation)."""
        return gather_mapped_rows(local_ids, self._mapped_words, self.row_bytes, self.device)

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        return self._read_mapped(self._mapped, row_ids, col_end, out)
