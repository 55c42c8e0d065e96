"""Synthetic packed rows: the one definition every demo, test, bench and fill uses.

Byte ``j`` of global row ``r`` is a fixed integer hash of ``(seed, r, j)``
(:func:`synthetic_packed_rows`): value bytes avoid the two e4m3fn NaN codes
(0x7F, 0xFF are remapped to +-448) and scale bytes lie in 110..135 (scales
2**-17 .. 2**8), so every dequantised value is finite and no row is zeros. A
row is the same on every device and whatever range or shard asks for it: the
synthetic tier computes rows on the fly from this function, and
:func:`engramrt.distributed.fill.synthetic_rows_numpy` is the same arithmetic in
numpy (tested bit for bit) for filling host tables fast.
"""

from __future__ import annotations

import torch

from engramrt.packed import row_bytes_for

__all__ = ["random_packed_rows", "synthetic_packed_rows"]

_P = 2_147_483_629  # a prime below 2**31: every product below stays < 2**62
_A, _B, _C = 1_103_515_245, 40_503, 2_654_435_761 % _P
_PIECE_ROWS = 1 << 16


def _mix(h: torch.Tensor) -> torch.Tensor:
    """Two rounds of a multiplicative hash mod a prime (int64, no overflow)."""
    h = (h * _A + 12_345) % _P
    h = h ^ (h >> 13)
    return (h * _C + 1) % _P


def synthetic_packed_rows(row_ids: torch.Tensor, E: int, seed: int = 0) -> torch.Tensor:
    """``[..., E + E/32]`` uint8 packed rows of the global ``row_ids`` (any int dtype)."""
    row_bytes = row_bytes_for(E)
    r = row_ids.to(torch.int64).unsqueeze(-1) % _P  # [..., 1]
    j = torch.arange(row_bytes, device=row_ids.device, dtype=torch.int64)
    h = _mix((r * _B + j * 7_919 + seed * 104_729) % _P)
    values = (h[..., :E] & 0xFF).to(torch.uint8)
    values ^= ((values & 0x7F) == 0x7F).to(torch.uint8)  # NaN codes 0x7F/0xFF -> +-448
    scales = (110 + h[..., E:] % 26).to(torch.uint8)
    return torch.cat([values, scales], dim=-1)


def random_packed_rows(
    num_rows: int,
    E: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[num_rows, E + E/32]`` uint8: :func:`synthetic_packed_rows` of ``num_rows``
    consecutive rows from a first row drawn with ``generator`` (benches that fill tables
    piece by piece and need rows that are finite and differ from piece to piece).

    Computed ``_PIECE_ROWS`` rows at a time, so the int64 temporaries stay near 140 MB
    whatever ``num_rows`` is.
    """
    where = generator.device if generator is not None else torch.device("cpu")
    first = int(torch.randint(0, _P, (1,), generator=generator, device=where))
    out = torch.empty((num_rows, row_bytes_for(E)), dtype=torch.uint8, device=device)
    for begin in range(0, num_rows, _PIECE_ROWS):
        end = min(num_rows, begin + _PIECE_ROWS)
        row_ids = torch.arange(first + begin, first + end, dtype=torch.int64, device=device)
        out[begin:end] = synthetic_packed_rows(row_ids, E)
    return out
