"""Row quantisation of Engram tables: fp8 e4m3fn values with ue8m0 block scales.

``quantize_rows`` turns float rows into what a checkpoint stores and
``dequantize_rows`` turns stored rows back into bf16 (SPEC §6). The
definition is :mod:`.reference`; :mod:`.kernel` holds Triton kernels that
agree with it bit for bit; ``backend`` picks one (see
:func:`engramrt._backend.resolve_backend`). Triton is imported only when a
kernel runs.
"""

from __future__ import annotations

import torch

from engramrt._backend import resolve_backend
from engramrt.errors import ValidationError
from engramrt.quant.reference import (
    BLOCK,
    CANONICAL_BF16_NAN_BITS,
    E4M3_MAX,
    SCALE_FLOOR,
    dequantize_rows_reference,
    quantize_rows_reference,
    scale_bytes_to_fp32,
)

__all__ = [
    "BLOCK",
    "CANONICAL_BF16_NAN_BITS",
    "E4M3_MAX",
    "SCALE_FLOOR",
    "check_row_width",
    "dequantize_rows",
    "dequantize_rows_reference",
    "quantize_rows",
    "quantize_rows_reference",
    "scale_bytes_to_fp32",
]

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
_VALUE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def check_row_width(name: str, row_width: int) -> None:
    """Raise unless ``row_width`` (``E``) is a positive multiple of 32."""
    if row_width <= 0 or row_width % BLOCK != 0:
        raise ValidationError(
            f"{name} has rows of {row_width} values; expected a positive multiple of {BLOCK} "
            f"(one ue8m0 scale per block of {BLOCK})"
        )


def quantize_rows(
    x: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise float rows to e4m3fn values and ue8m0 scale bytes (SPEC §6).

    Args:
        x: ``[..., E]`` float32, bfloat16 or float16; ``E`` a multiple of 32.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        validate: check ``x``'s dtype and shape on the host (never
            synchronises).
        check_finite: check that ``x`` is finite (one host synchronisation;
            on by default: quantising runs offline, in conversion, where a
            non-finite value would silently spoil a stored row). Non-finite
            input has no defined quantisation; unchecked, its bytes are
            unspecified.

    Returns:
        ``(values [..., E] float8_e4m3fn, scales [..., E/32] uint8)`` on
        ``x``'s device.
    """
    if validate:
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
            found = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValidationError(
                f"x has dtype {found}; expected one of float32, bfloat16, float16"
            )
        if x.dim() < 1:
            raise ValidationError(f"x has shape {tuple(x.shape)}; expected [..., E]")
        check_row_width("x", x.shape[-1])
    if check_finite and x.numel() > 0 and not bool(torch.isfinite(x).all()):
        bad = torch.nonzero(~torch.isfinite(x))[0].tolist()
        raise ValidationError(
            f"x{bad} = {x[tuple(bad)].item()}; expected finite values (a non-finite block has no scale)"
        )
    if resolve_backend(backend, x.device) == "reference":
        return quantize_rows_reference(x)
    from engramrt.quant.kernel import quantize_rows_triton

    return quantize_rows_triton(x)


def _check_pair(values: torch.Tensor, scales: torch.Tensor) -> None:
    if values.dtype not in _VALUE_DTYPES:
        raise ValidationError(
            f"values has dtype {values.dtype}; expected torch.float8_e4m3fn (or uint8 bytes)"
        )
    if scales.dtype not in _SCALE_DTYPES:
        raise ValidationError(
            f"scales has dtype {scales.dtype}; expected torch.uint8 or torch.float8_e8m0fnu"
        )
    if values.dim() < 1:
        raise ValidationError(f"values has shape {tuple(values.shape)}; expected [..., E]")
    check_row_width("values", values.shape[-1])
    expected = (*values.shape[:-1], values.shape[-1] // BLOCK)
    if tuple(scales.shape) != expected:
        raise ValidationError(
            f"scales has shape {tuple(scales.shape)}; expected {expected} "
            f"(one byte per {BLOCK} values of values {tuple(values.shape)})"
        )
    if values.device != scales.device:
        raise ValidationError(
            f"scales is on {scales.device}; expected values' device {values.device}"
        )


def dequantize_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    hw_convert: bool = False,
) -> torch.Tensor:
    """``bf16(fp32(value) * 2**(scale_byte - 127))`` per block of 32 (SPEC §6).

    Args:
        values: ``[..., E]`` float8_e4m3fn (or uint8 with its bytes).
        scales: ``[..., E/32]`` uint8 or float8_e8m0fnu (same bytes).
        out: optional contiguous ``[..., E]`` bfloat16 to write into.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        hw_convert: kernel variant using the GPU's conversion instructions
            (same bytes on a GPU; see :mod:`engramrt.quant.kernel`).

    Returns:
        ``[..., E]`` bfloat16; NaN results are the canonical ``0x7FC0``.
    """
    _check_pair(values, scales)
    if out is not None and (
        out.dtype != torch.bfloat16
        or tuple(out.shape) != tuple(values.shape)
        or not out.is_contiguous()
        or out.device != values.device
    ):
        raise ValidationError(
            f"out is {out.dtype} {tuple(out.shape)} on {out.device} (contiguous: "
            f"{out.is_contiguous()}); expected contiguous bfloat16 {tuple(values.shape)} "
            f"on {values.device}"
        )
    if resolve_backend(backend, values.device) == "reference":
        rows = dequantize_rows_reference(values, scales)
        if out is None:
            return rows
        return out.copy_(rows)
    from engramrt.quant.kernel import dequantize_rows_triton

    if out is None:
        out = torch.empty(values.shape, dtype=torch.bfloat16, device=values.device)
    return dequantize_rows_triton(values, scales, out, hw_convert=hw_convert)
