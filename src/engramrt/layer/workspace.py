"""A head's fixed buffers: allocated once by ``reserve(max_tokens)``, sliced per step.

Every :class:`~engramrt.protocols.LayerHead` owns its workspace; these two helpers are
the allocation and the slice they share (NaN-poisoned, so a slice never written shows).
"""

from __future__ import annotations

import torch

from engramrt.errors import ValidationError

__all__ = ["fixed_buffer", "leading_rows"]


def fixed_buffer(
    max_tokens: int, *shape: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[max_tokens, *shape]`` of ``dtype`` on ``device``, filled with NaN."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValidationError(f"max_tokens={max_tokens!r}; expected a positive integer")
    return torch.full((max_tokens, *shape), float("nan"), dtype=dtype, device=device)


def leading_rows(buffer: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` rows of a head's fixed ``buffer`` (None: not reserved)."""
    if buffer is None:
        raise ValidationError(
            "output_buffer() before reserve(max_tokens): the head has no fixed buffers yet"
        )
    return buffer[:num_tokens]
