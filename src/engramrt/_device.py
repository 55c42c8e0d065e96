"""Which device a part runs on when the caller leaves it open: one rule for the package."""

from __future__ import annotations

from typing import Any

import torch

from engramrt.errors import ValidationError

__all__ = ["capturing", "check_device", "default_compute_device", "resolve_device"]


def default_compute_device() -> torch.device:
    """The current CUDA device when there is one, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def capturing(device: torch.device) -> bool:
    """Whether work queued now on ``device`` is being captured into a CUDA graph (never on
    a CPU, where torch's capture query is not available)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``device`` as a ``torch.device`` with an index: None or ``"auto"`` is
    :func:`default_compute_device`; ``"cuda"`` is ``cuda:<current>``, so it compares
    equal to the devices of the tensors made there."""
    if device is None or device == "auto":
        return default_compute_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(name: str, value: Any, *, allow_auto: bool = False) -> torch.device:
    """``value`` as a ``torch.device`` engramrt can compute on, or one
    :class:`~engramrt.errors.ValidationError` naming ``name``: ``cpu``, ``cuda`` or
    ``cuda:N`` (``auto`` too when ``allow_auto``: :func:`default_compute_device`) on a
    device this machine has. ``"cuda"`` stays without an index (the current device at use).

    Refused up front: a string torch cannot parse (``"tpu"``, ``""``), a value that is no
    device (``5``), another device type (``"meta"`` holds no data, ``"mps"``), and a CUDA
    device this process cannot see.
    """
    choices = "auto, cpu, cuda or cuda:N" if allow_auto else "cpu, cuda or cuda:N"
    if allow_auto and value == "auto":
        return default_compute_device()
    if not isinstance(value, (str, torch.device)):
        raise ValidationError(
            f"{name}={value!r} ({type(value).__name__}); expected a device: {choices}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValidationError(f"{name}={value!r} is not a device; expected {choices}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValidationError(f"{name}={value!r}: engramrt runs on {choices}, not {device.type!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValidationError(f"{name}={value!r} but no CUDA device is visible; use cpu")
        if device.index is not None and device.index >= count:
            raise ValidationError(
                f"{name}={value!r} but only {count} CUDA device(s) are visible "
                f"(cuda:0 to cuda:{count - 1})"
            )
    return device
