"""Helpers shared by the test packages: where kernel tests run, the storage tiers and a
store of each, random packed tables (and bf16 ones) and bit-for-bit comparison of rows.

``tests/conftest.py`` sets ``TRITON_INTERPRET`` before any test module is imported, so
a module that imports kernels needs no prologue of its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.lookup.stores import store_of

from engramrt.lookup import pack_rows, row_bytes_for
from engramrt.lookup.tiers import RowStore, tier_class

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

TIERS = [
    "device",
    pytest.param(
        "uva",
        marks=pytest.mark.skipif(
            not CUDA, reason="UVA maps host memory into a GPU's address space; no GPU here"
        ),
    ),
    "host",
    "disk",
]
"""Every storage tier, for ``@pytest.mark.parametrize("tier", TIERS)`` (UVA needs a GPU)."""


def tier_store(
    tier: str,
    table: torch.Tensor,
    tmp_path: Path,
    *,
    device: torch.device = DEVICE,
    row_begin: int = 0,
    col_begin: int = 0,
    col_end: int | None = None,
    **options: object,
) -> RowStore:
    """A store of ``tier`` (its options class made from ``options``) holding the packed rows
    ``table`` as rows ``[row_begin, ...)`` that serve columns ``[col_begin, col_end)``, its
    file (for the tiers that keep one) under ``tmp_path``."""
    return store_of(
        tier_class(tier).options_type(**options),  # type: ignore[arg-type]
        table,
        device=device,
        row_begin=row_begin,
        col_begin=col_begin,
        col_end=col_end,
        path=tmp_path / f"{tier}.rows",
    )


def random_packed_table(num_rows: int, E: int, seed: int, *, finite: bool = False) -> torch.Tensor:
    """``[num_rows, E + E/32]`` uint8 packed rows drawn from ``seed``.

    ``finite=False``: every fp8 code (the NaN codes 0x7F and 0xFF included) and scale
    bytes 110..135, for lookups compared byte for byte. ``finite=True``: the NaN codes
    turned into +-448 and scale bytes 118..131, for tests whose products of rows and
    weights must stay finite.
    """
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (num_rows, E), generator=g, dtype=torch.uint8)
    if finite:
        values ^= ((values & 0x7F) == 0x7F).to(torch.uint8)  # NaN codes 0x7F/0xFF -> +-448
    low, high = (118, 132) if finite else (110, 136)
    scales = torch.randint(low, high, (num_rows, E // 32), generator=g, dtype=torch.uint8)
    packed = pack_rows(values.view(torch.float8_e4m3fn), scales)
    assert packed.shape[1] == row_bytes_for(E)
    return packed


def random_bf16_rows(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """``[num_rows, 2 * width]`` uint8: bf16 rows (``row_format=BF16``) of every bit pattern
    (NaNs, infinities, subnormals and -0.0 included), as the bytes a store holds."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (num_rows, width), generator=g, dtype=torch.int16)
    return bits.view(torch.bfloat16).view(torch.uint8)


def assert_same_bits(found: torch.Tensor, expected: torch.Tensor, label: str = "rows") -> None:
    """Both bf16, equal shapes and bit patterns; the first differences in the message."""
    assert found.shape == expected.shape, (
        f"{label}: shape {tuple(found.shape)} != {tuple(expected.shape)}"
    )
    assert found.dtype == expected.dtype == torch.bfloat16, (
        f"{label}: dtypes {found.dtype}, {expected.dtype}; expected torch.bfloat16"
    )
    a = found.detach().cpu().view(torch.int16)
    b = expected.detach().cpu().view(torch.int16)
    diff = (a != b).nonzero()
    if diff.numel():
        first = ", ".join(
            f"{tuple(i)}: {int(a[tuple(i)]) & 0xFFFF:#06x} != {int(b[tuple(i)]) & 0xFFFF:#06x}"
            for i in diff[:8].tolist()
        )
        raise AssertionError(f"{label}: {diff.shape[0]} values differ; first at {first}")


def finite_packed_table(num_rows: int, E: int, seed: int) -> torch.Tensor:
    """:func:`random_packed_table` with ``finite=True``: rows for layers and exchanges."""
    return random_packed_table(num_rows, E, seed, finite=True)


def assert_import_is_lean(*modules: str) -> None:
    """Importing ``modules`` (and torch) in a fresh interpreter loads no Triton and
    initialises no GPU."""
    code = (
        f"import sys, torch, {', '.join(modules)}\n"
        "loaded = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
        "assert not loaded, loaded\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def switchable_gpu_reads(backing: RowStore) -> dict[str, bool]:
    """Give a device-memory ``backing`` the host tier's switch of GPU reads: its
    ``use_gpu_reads(on)`` is recorded in the returned ``{"on": ...}`` (True at first) and
    ``device_rows()`` offers its rows to a probe only while it is on."""
    rows = backing.device_rows()
    reads = {"on": True}

    def use_gpu_reads(on: bool) -> bool:
        reads["on"] = on
        return True

    backing.use_gpu_reads = use_gpu_reads  # type: ignore[method-assign]
    backing.device_rows = lambda: rows if reads["on"] else None  # type: ignore[method-assign]
    return reads
