"""Shared helpers of the cache tests."""

from __future__ import annotations

import torch

from engramrt.lookup import pack_rows


def random_packed_table(num_rows: int, E: int, seed: int) -> torch.Tensor:
    """Random value bytes (NaN codes included) and scale bytes in 110..135."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (num_rows, E), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 136, (num_rows, E // 32), generator=g, dtype=torch.uint8)
    return pack_rows(values.view(torch.float8_e4m3fn), scales)


def skewed_ids(
    shape: tuple[int, ...], low: int, high: int, generator: torch.Generator, power: float = 3.0
) -> torch.Tensor:
    """int64 ids in ``[low, high)``, most of them near ``low`` (``u**power``)."""
    u = torch.rand(shape, generator=generator) ** power
    return low + (u * (high - low)).long().clamp(max=high - low - 1)


def assert_same_bits(found: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 tensors equal bit for bit; the first mismatches in the message."""
    assert found.shape == expected.shape, f"shape {tuple(found.shape)} != {tuple(expected.shape)}"
    assert found.dtype == expected.dtype == torch.bfloat16
    a = found.view(torch.int16).cpu()
    b = expected.view(torch.int16).cpu()
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ; first at " + ", ".join(
        f"{tuple(i)}: {a[tuple(i)].item() & 0xFFFF:#06x} != {b[tuple(i)].item() & 0xFFFF:#06x}"
        for i in diff[:8].tolist()
    )
