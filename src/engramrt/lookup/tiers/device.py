"""Device tier: the packed table lives in the compute device's memory.

The fastest tier: one launch of the gather + dequantise kernel, no host
synchronisation, capturable in a CUDA graph. On a machine without a GPU the
"device" is the CPU: the table is a CPU tensor served by the reference
(or by the kernel under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engramrt import memory
from engramrt.lookup import lookup_rows
from engramrt.lookup.tiers.base import KernelRowStore, register_tier
from engramrt.lookup.tiers.options import KernelTierOptions

__all__ = ["DeviceOptions", "DeviceRowStore"]


@dataclass(frozen=True)
class DeviceOptions(KernelTierOptions):
    """Settings of tier ``"device"``: the checks, ``backend`` and ``kernel``
    (see :class:`~engramrt.lookup.tiers.options.KernelTierOptions`)."""

    tier = "device"


@register_tier
class DeviceRowStore(KernelRowStore):
    """Packed rows in device memory (HBM), or in CPU memory on a CPU-only machine.

    Args: see :class:`RowStore`; options: :class:`DeviceOptions`.

    Raises:
        CapacityError: the device (or, on a CPU device, the host) has less
            free memory than the table needs.
    """

    tier = "device"
    options_type = DeviceOptions

    def _setup(self) -> None:
        super()._setup()
        what = f"tier='device' ({self.num_rows} rows of {self.row_bytes} B)"
        if self.device.type == "cuda":
            memory.require(
                what, self.nbytes, memory.device_free_bytes(self.device), str(self.device)
            )
        else:
            memory.require(what, self.nbytes, memory.host_available_bytes(), "host memory")
        self.table = torch.empty(
            (self.num_rows, self.row_bytes), dtype=torch.uint8, device=self.device
        )

    def _write(self, start: int, packed: torch.Tensor) -> None:
        self.table[start : start + packed.shape[0]].copy_(packed)

    def device_rows(self) -> torch.Tensor:
        return self.table

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, local_ids.to(self.device))

    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        return lookup_rows(
            row_ids.to(self.device, non_blocking=True),
            self.table,
            col_begin=self.col_begin,
            col_end=col_end,
            row_begin=self.row_begin,
            out=out,
            backend=self.backend,
            validate=False,  # checked once, by lookup()
            kernel=self.kernel,
        )
