"""Shared helpers of the cache tests."""

from __future__ import annotations

import torch


def skewed_ids(
    shape: tuple[int, ...], low: int, high: int, generator: torch.Generator, power: float = 3.0
) -> torch.Tensor:
    """int64 ids in ``[low, high)``, most of them near ``low`` (``u**power``)."""
    u = torch.rand(shape, generator=generator) ** power
    return low + (u * (high - low)).long().clamp(max=high - low - 1)
