"""The packed-row format of Engram tables (SPEC §6).

A table is stored *packed*: one uint8 row of ``E + E/32`` bytes, the ``E``
float8 e4m3fn value bytes followed by the ``E/32`` ue8m0 scale bytes (264 B
for ``E = 256``), so one lookup reads one contiguous row. Every tier,
kernel and file of engramrt holds rows in this format.
"""

from __future__ import annotations

import torch

from engramrt.errors import ValidationError
from engramrt.quant.reference import BLOCK

__all__ = [
    "check_packed_rows",
    "pack_rows",
    "row_bytes_for",
    "row_width_for",
    "unpack_rows",
    "word_dtype_for",
]


def row_bytes_for(row_width: int) -> int:
    """Bytes of one packed row of ``row_width`` (``E``) values: ``E + E/32``."""
    return row_width + row_width // BLOCK


_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_dtype_for(row_bytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``row_bytes`` (int64 for 264-byte rows)."""
    for size, dtype in _WORD_DTYPES:
        if row_bytes % size == 0:
            return dtype
    raise AssertionError("unreachable: a 1-byte word divides every row")  # pragma: no cover


def row_width_for(row_bytes: int) -> int:
    """``E`` of a packed row of ``row_bytes`` bytes (inverse of :func:`row_bytes_for`)."""
    row_width = row_bytes * BLOCK // (BLOCK + 1)
    if row_bytes <= 0 or row_bytes_for(row_width) != row_bytes or row_width % BLOCK != 0:
        raise ValidationError(
            f"packed rows have {row_bytes} bytes; expected E + E/32 for E a positive multiple "
            f"of {BLOCK} (264 for E=256)"
        )
    return row_width


def pack_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., E]`` fp8 values and ``[..., E/32]`` scale bytes -> ``[..., E + E/32]`` uint8."""
    if values.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValidationError(
            f"values has dtype {values.dtype}; expected torch.float8_e4m3fn (or uint8 bytes)"
        )
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValidationError(
            f"scales has dtype {scales.dtype}; expected torch.uint8 or torch.float8_e8m0fnu"
        )
    row_width = values.shape[-1] if values.dim() > 0 else 0
    expected = (*values.shape[:-1], row_width // BLOCK)
    if row_width <= 0 or row_width % BLOCK != 0 or tuple(scales.shape) != expected:
        raise ValidationError(
            f"values {tuple(values.shape)} and scales {tuple(scales.shape)}; expected "
            f"[..., E] with E a positive multiple of {BLOCK} and scales {expected}"
        )
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack_rows(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., E + E/32]`` uint8 -> (``[..., E]`` float8_e4m3fn, ``[..., E/32]`` uint8), views."""
    if packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValidationError(
            f"packed is {packed.dtype} {tuple(packed.shape)}; expected uint8 [..., E + E/32]"
        )
    row_width = row_width_for(packed.shape[-1])
    values = packed[..., :row_width].view(torch.float8_e4m3fn)
    return values, packed[..., row_width:]


def check_packed_rows(name: str, rows: object, *, on_cpu: bool = False) -> int:
    """``E`` of ``rows``, a contiguous uint8 ``[num_rows, E + E/32]`` tensor (in CPU memory
    when ``on_cpu``); a :class:`ValidationError` naming ``name`` otherwise."""
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dtype != torch.uint8
        or rows.dim() != 2
        or (on_cpu and rows.device.type != "cpu")
        or not rows.is_contiguous()
    ):
        found = (
            f"{rows.dtype} {tuple(rows.shape)} on {rows.device} (contiguous: {rows.is_contiguous()})"
            if isinstance(rows, torch.Tensor)
            else type(rows).__name__
        )
        where = " CPU" if on_cpu else ""
        raise ValidationError(
            f"{name} is {found}; expected contiguous{where} uint8 [num_rows, E + E/32]"
        )
    return row_width_for(rows.shape[1])
