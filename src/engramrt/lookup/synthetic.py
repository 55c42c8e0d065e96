"""Random packed rows for tests, demos and benchmarks (never zeros)."""

from __future__ import annotations

import torch

from engramrt.packed import row_bytes_for

__all__ = ["random_packed_rows"]


def random_packed_rows(
    num_rows: int,
    E: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[num_rows, E + E/32]`` uint8: random fp8 values, scale bytes 110..135.

    The two e4m3fn NaN codes (0x7F, 0xFF) are remapped to +-448 and the
    scales kept near 1 (2**-17 .. 2**8), so every dequantised value is finite.
    """
    rows = torch.randint(
        0, 256, (num_rows, row_bytes_for(E)), dtype=torch.uint8, device=device, generator=generator
    )
    values = rows[:, :E]
    values ^= ((values & 0x7F) == 0x7F).to(torch.uint8)
    rows[:, E:] = torch.randint(
        110, 136, (num_rows, E // 32), dtype=torch.uint8, device=device, generator=generator
    )
    return rows
