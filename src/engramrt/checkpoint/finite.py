"""Refuse non-finite tables and weights at load, naming the tensor and the row.

A packed row dequantises to ``value * 2**(scale_byte - 127)`` per block of
32 (SPEC §6). It is non-finite when a value byte is an e4m3fn NaN code
(``0x7F`` or ``0xFF``), when a scale byte is the ue8m0 NaN ``0xFF``, or when
the product overflows fp32 (and bf16, whose exponent range is the same):
``|value| * 2**(b - 127) >= 2**128``, possible only for scale bytes
``b >= 247`` with large values (448 = 1.75 * 2**8 is the largest e4m3
value). The checks run over the bytes the loader already holds: one compare
per value byte, two per scale byte, and an exact product only for the rare
scale bytes of 247 and up.
"""

from __future__ import annotations

import torch

from engramrt.errors import CheckpointError

__all__ = ["check_head_weight", "check_packed_rows_finite", "check_scale_rows_finite"]

_FP8_NAN_MAGNITUDE = 0x7F  # e4m3fn: S.1111.111 is NaN (no inf)
_E8M0_NAN = 0xFF
_FIRST_RISKY_SCALE = 247  # below it no e4m3 value overflows: 448 * 2**119 < 2**128
_MAGNITUDES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def _first(mask: torch.Tensor) -> tuple[int, int]:
    """(row, column) of the first true element of a 2-D mask."""
    flat = int(torch.nonzero(mask.reshape(-1))[0, 0])
    return divmod(flat, mask.shape[1])


def check_scale_rows_finite(scales: torch.Tensor, *, name: str, row_begin: int) -> None:
    """Refuse ue8m0 NaN scale bytes in ``scales [n, E/32]`` (rows from global ``row_begin``)."""
    raw = scales.view(torch.uint8)
    nan = raw == _E8M0_NAN
    if bool(nan.any()):
        row, col = _first(nan)
        raise CheckpointError(
            f"tensor {name!r} row {row_begin + row} holds scale byte 0xff (ue8m0 NaN) in block "
            f"{col}; expected finite scales (bytes 0..254)"
        )


def check_packed_rows_finite(
    values: torch.Tensor,
    scales: torch.Tensor,
    *,
    weight_name: str,
    scale_name: str,
    row_begin: int,
) -> None:
    """Refuse rows of ``values [n, E]`` (fp8 bytes) and ``scales [n, E/32]`` that dequantise
    to NaN or inf; the error names the tensor, the global row (``row_begin + i``), the
    column or block and the byte found."""
    raw = values.view(torch.uint8)
    nan = (raw & 0x7F) == _FP8_NAN_MAGNITUDE
    if bool(nan.any()):
        row, col = _first(nan)
        raise CheckpointError(
            f"tensor {weight_name!r} row {row_begin + row} holds fp8 NaN code "
            f"0x{int(raw[row, col]):02x} at column {col}; expected finite e4m3fn values"
        )
    check_scale_rows_finite(scales, name=scale_name, row_begin=row_begin)
    scale_bytes = scales.view(torch.uint8)
    risky = scale_bytes >= _FIRST_RISKY_SCALE
    if not bool(risky.any()):
        return
    n, blocks = scale_bytes.shape
    largest = (raw & 0x7F).reshape(n, blocks, -1).amax(dim=2)  # [n, E/32] magnitude codes
    magnitude = _MAGNITUDES.to(largest.device)[largest.long()]
    exponent = scale_bytes.to(torch.float64) - 127
    overflow = risky & (magnitude * torch.exp2(exponent) >= 2.0**128)
    if bool(overflow.any()):
        row, block = _first(overflow)
        raise CheckpointError(
            f"tensor {scale_name!r} row {row_begin + row} block {block}: scale byte "
            f"0x{int(scale_bytes[row, block]):02x} (2**{int(scale_bytes[row, block]) - 127}) "
            f"times value {float(magnitude[row, block]):g} of {weight_name!r} overflows to inf; "
            f"expected rows that dequantise to finite numbers"
        )


def check_head_weight(tensor: torch.Tensor, *, name: str, positive: bool = False) -> None:
    """Refuse a head weight holding NaN or inf (``positive``: a scale, also <= 0), naming
    the tensor and the first bad element's index and value."""
    if tensor.device.type == "meta":
        raise CheckpointError(
            f"tensor {name!r} is on the meta device (shape {list(tensor.shape)}): it holds no "
            f"data; expected a tensor with its values"
        )
    data = tensor.float() if tensor.dtype == torch.float8_e4m3fn else tensor
    if not (data.is_floating_point() or data.is_complex()):
        return
    bad = ~torch.isfinite(data)
    if positive:
        bad = bad | (data <= 0)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        value = float(data[index])
        wanted = "finite scales > 0" if positive else "finite values"
        raise CheckpointError(f"tensor {name!r} holds {value} at {list(index)}; expected {wanted}")
