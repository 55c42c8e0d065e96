"""Which device a part runs on when the caller leaves it open: one rule for the package."""

from __future__ import annotations

import torch

__all__ = ["default_compute_device", "resolve_device"]


def default_compute_device() -> torch.device:
    """The current CUDA device when there is one, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
