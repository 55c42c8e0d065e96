"""The lookup kernels over packed rows in registered host memory (read over PCIe).

Host memory registered with CUDA (``cudaHostRegister``, portable + mapped)
is readable by the device through unified virtual addressing, so the same
kernels that read a device table read it, each row crossing the bus once.
Triton refuses pointers it cannot map to the device; it resolves a pointer
argument with ``cuPointerGetAttribute(DEVICE_POINTER)``, which for
registered host memory returns its device address. So the kernels receive
a :class:`MappedHostRows`: an object whose ``data_ptr()`` is the host
address and whose ``dtype`` is the element type read.

Used by the UVA tier (every lookup), the host tier (the GPU's reads of a
small batch and its share of a large one) and the cache (misses read by
the probe).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelConfig

__all__ = ["MappedHostRows", "gather_mapped_rows", "lookup_mapped_rows"]


class MappedHostRows:
    """What Triton needs of a pointer argument: ``data_ptr()`` and ``dtype``.

    Args:
        host_pointer: registered host memory (see the module doc).
        num_rows: packed rows there; the kernels read no row past them.
        dtype: the element type the kernel reads it as.
    """

    def __init__(self, host_pointer: int, num_rows: int, dtype: torch.dtype = torch.uint8) -> None:
        self._host_pointer = host_pointer
        self.num_rows = num_rows
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._host_pointer

    def view(self, dtype: torch.dtype) -> MappedHostRows:
        """The same rows read as ``dtype`` elements (as ``Tensor.view`` of a dtype)."""
        return MappedHostRows(self._host_pointer, self.num_rows, dtype)


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
    kernel: LookupKernelConfig = DEFAULT_KERNEL,
) -> torch.Tensor:
    """The lookup kernel over rows in registered host memory (``mapped``, bytes)."""
    from engramrt.lookup.kernel import lookup_rows_triton  # imports Triton

    row_ids = row_ids.to(device, non_blocking=True)
    if out is None:
        out = torch.empty((*row_ids.shape, E), dtype=torch.bfloat16, device=device)
    # Entering torch.cuda.device costs microseconds of a decode step's lookup: only
    # when the device is not the current one.
    with _on_device(device):
        return lookup_rows_triton(
            row_ids,
            mapped,
            out,
            E=E,
            col_begin=col_begin,
            col_end=col_end,
            row_begin=row_begin,
            num_rows=mapped.num_rows,
            kernel=kernel,
        )


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)``, or nothing when ``device`` is already current."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


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
    host memory (``mapped_words``, viewed as :func:`engramrt.packed.word_dtype_for` words)."""
    from engramrt.lookup.kernel import gather_packed_rows_triton  # imports Triton

    row_ids = row_ids.to(device, non_blocking=True)
    if out is None:
        out = torch.empty((row_ids.shape[0], row_bytes), dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        return gather_packed_rows_triton(
            row_ids, mapped_words, out, row_begin=row_begin, num_rows=mapped_words.num_rows
        )
