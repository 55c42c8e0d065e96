"""Triton gather + dequantise kernel for the row lookup.

Design (one launch, no host synchronisation, capturable in a CUDA graph):

- The ``T * C`` lookups are flattened; each program serves ``ROWS``
  consecutive ones as a tile ``[ROWS, NB, 32]`` (rows x scale blocks x
  values), so every program has ``ROWS * 264`` independent bytes in flight
  for ``E = 256`` and a block's scale broadcasts over its 32 values without
  a reshape. ``ROWS * E = 4096`` by default: with 4 warps each thread
  issues four 8-byte loads and four 16-byte stores.
- Every index is int64 (program id cast first): ``row_id * 264`` overflows
  int32 past 8.1 M rows, far below a V4.1 table's 384 M.
- Loads: a packed row starts at ``local_row * (E + E/32)``, a multiple of 8
  for ``E = 256``, which Triton's alignment analysis sees (a product's
  divisibility is the product of the factors'), so the value bytes load as
  8-byte vectors. 16-byte vectors would need 16-byte aligned row starts;
  264-byte rows alternate between 0 and 8 mod 16, so 8 bytes is the widest
  load that is legal for every row without padding the table format.
- Non-owned columns (tensor-parallel shards) load nothing and store +0.0.
- Memory-safe without checks: an owned id outside the table's rows
  ``[row_begin, row_begin + num_rows)`` loads nothing and stores +0.0, as
  :func:`engramrt.lookup.reference.lookup_rows_reference` defines; no id
  makes the kernel read outside the table.
- Conversions are the integer formulations of :mod:`engramrt.quant.kernel`,
  so the bytes equal :func:`engramrt.lookup.reference.lookup_rows_reference`
  on the GPU and in Triton's interpreter alike (about 15 integer/float
  operations per value). ``hw_convert`` (by default on a GPU) swaps in the
  GPU's conversion instructions (about 6 per value): the integer pipe, not
  memory, bounds the lookup from device memory on the H200; the bytes are
  checked equal on the GPU (tests/lookup/test_lookup.py).

``table`` may be any object with ``data_ptr()`` and ``dtype`` (Triton only
uses those), e.g. a pointer to pinned host memory mapped into the device's
address space (the UVA tier).

Levers (:class:`~engramrt.lookup.settings.LookupKernelConfig`; every one
writes the same bytes) and why each should help:

- ``rows_per_program`` and ``num_warps``: bytes in flight per program. A
  read of host memory over PCIe waits microseconds per round trip whatever
  its size, so a program that issues more rows at once (a bigger tile, more
  warps to issue it) hides more of that latency, up to what the link
  sustains for small scattered reads: past that, more requests only queue
  (on the H200, 6,144 rows in flight at once read slower than ~800 at a
  time; see :data:`engramrt.lookup.tiers.uva.UVA_KERNEL`). From device
  memory a bigger tile amortises the id load and index arithmetic per row.
- ``max_programs``: a bounded grid. Programs reading host memory mostly
  wait, yet hold their multiprocessor's slots; a grid that does not grow
  with the batch leaves the GPU to the model beside it, and bounds the
  requests in flight. Each program serves its tiles one after the other,
  so its round trips add up: too few programs (or too small tiles) and the
  chain of round trips, not the link, bounds the read.
- ``num_stages``: pipelining of that loop over tiles, so the loads of the
  next tile may be issued before the current one is stored.
- ``cache_modifier``: ``.cg`` keeps rows (read once) out of L1.
- ``cached_launch``: the compiled kernel is called directly instead of
  binding ~20 arguments in Python on every call; at a decode step that
  binding is a large part of the lookup's time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from engramrt._backend import interpreter_enabled
from engramrt._jit import flat_lookups, program_block, store_dequantized_rows
from engramrt._launch import CachedLauncher
from engramrt.lookup.settings import DEFAULT_KERNEL, LookupKernelConfig
from engramrt.packed import word_dtype_for

__all__ = [
    "DEFAULT_NUM_WARPS",
    "DEFAULT_TILE_ELEMENTS",
    "GATHER_ROWS_PER_PROGRAM",
    "gather_packed_rows_triton",
    "lookup_rows_triton",
]

DEFAULT_TILE_ELEMENTS = 4096
"""Values per program (``ROWS * E``)."""

DEFAULT_NUM_WARPS = 4

GATHER_ROWS_PER_PROGRAM = 8
"""Rows per program of :func:`gather_packed_rows_triton`: a small tile, as for every
read of scattered rows from host memory (chosen by measurement against 4, 16 and
32 rows)."""


@triton.jit(do_not_specialize=["num_rows"])
def _lookup_rows_kernel(
    row_ids_ptr,  # [T, C] int32 / int64, strides (stride_t, stride_c)
    table_ptr,  # [num_rows, ROW_BYTES] uint8, packed rows
    out_ptr,  # [T, C, E] int16 (bf16 bits), contiguous
    n_lookups,  # T * C
    num_cols,  # C
    stride_t,
    stride_c,
    col_begin,
    col_end,
    row_begin,
    num_rows,  # rows of the table: ids outside [row_begin, row_begin + num_rows) read zeros
    E: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    TILES: tl.constexpr,  # consecutive tiles per program
    CACHE: tl.constexpr,  # cache operator of the table loads ("" = default)
):
    first_tile = tl.program_id(0).to(tl.int64) * TILES
    for i in range(TILES):
        lookup, in_batch, owned, row_id = flat_lookups(
            row_ids_ptr,
            first_tile + i,
            n_lookups,
            num_cols,
            stride_t,
            stride_c,
            col_begin,
            col_end,
            ROWS,
        )
        local_row = row_id - row_begin
        in_table = owned & (local_row >= 0) & (local_row < num_rows)
        local_row = tl.where(in_table, local_row, 0)
        row_ptrs = table_ptr + local_row * ROW_BYTES  # [ROWS]
        store_dequantized_rows(
            out_ptr, lookup, row_ptrs, in_table, in_batch, E, NB, NB_PAD, HW_CONVERT, CACHE
        )


# Binds the ~20 arguments through kernel[grid] once per specialisation, then
# calls the compiled kernel directly (see engramrt._launch).
_launch_lookup_rows = CachedLauncher(_lookup_rows_kernel)


def lookup_rows_triton(
    row_ids: torch.Tensor,
    table: Any,
    out: torch.Tensor,
    *,
    E: int,
    col_begin: int,
    col_end: int,
    row_begin: int,
    num_rows: int,
    kernel: LookupKernelConfig = DEFAULT_KERNEL,
) -> torch.Tensor:
    """Launch :func:`_lookup_rows_kernel` (inputs validated by the caller).

    Args:
        row_ids: ``[T, C]`` int32/int64 on the compute device (any strides).
        table: packed ``[num_rows, E + E/32]`` uint8 rows: a contiguous tensor
            or an object with ``data_ptr()`` and ``dtype`` readable by the device.
        out: contiguous ``[T, C, E]`` bf16, fully written.
        num_rows: rows of ``table``; an owned id outside
            ``[row_begin, row_begin + num_rows)`` reads a row of zeros.
        kernel: tile, warps, conversion variant and grid limit (see
            :class:`LookupKernelConfig`). With ``max_programs``, each
            program serves a power of two of consecutive tiles in turn:
            fewer programs hold fewer of the GPU's multiprocessors while a
            model runs beside reads of host memory.
    """
    n_lookups = row_ids.numel()  # T * C
    if n_lookups == 0:
        return out
    grid, options = _lookup_launch(E, kernel, n_lookups, interpreter_enabled())
    args = (
        row_ids,
        table,
        out.view(torch.int16),
        *flat_lookup_args(row_ids, col_begin, col_end),
        row_begin,
        num_rows,
    )
    if kernel.cached_launch:
        _launch_lookup_rows(grid, *args, **options)
    else:
        _lookup_rows_kernel[grid](*args, **options)
    return out


@functools.lru_cache(maxsize=4096)
def _lookup_launch(
    E: int, kernel: LookupKernelConfig, n_lookups: int, interpreted: bool
) -> tuple[tuple[int], dict[str, Any]]:
    """The grid and keywords of :func:`lookup_rows_triton`'s launch, computed once per
    shape and setting (a decode step repeats its shape; working them out again costs
    more host time than the launch itself). Callers must not change the dict."""
    rows = tile_shape(E, kernel.rows_per_program)[2]
    tiles = _cdiv(n_lookups, rows)
    per_program = tiles_per_program(tiles, kernel.max_programs)
    options = _row_tile_options(E, kernel, interpreted)
    options.update(TILES=per_program, CACHE=kernel.cache_modifier)
    if kernel.num_stages is not None:
        options["num_stages"] = kernel.num_stages
    return (_cdiv(tiles, per_program),), options


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``
    (a Triton ``constexpr_function``, which costs microseconds per call on the host)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tile_shape(E: int, rows_per_program: int | None) -> tuple[int, int, int]:
    """A lookup tile ``[ROWS, NB_PAD, 32]`` for rows of ``E`` values: the scale blocks
    ``NB = E / 32``, ``NB_PAD`` (the next power of two) and ``ROWS`` (a power of two;
    by default :data:`DEFAULT_TILE_ELEMENTS` values per tile)."""
    blocks = E // 32
    blocks_pad = _next_power_of_2(blocks)
    rows = rows_per_program or max(1, DEFAULT_TILE_ELEMENTS // (blocks_pad * 32))
    return blocks, blocks_pad, _next_power_of_2(rows)


def flat_lookup_args(row_ids: torch.Tensor, col_begin: int, col_end: int) -> tuple[int, ...]:
    """The launch arguments :func:`engramrt._jit.flat_lookups` reads of ``row_ids [T, C]``:
    ``(n_lookups, num_cols, stride_t, stride_c, col_begin, col_end)``."""
    num_tokens, num_cols = row_ids.shape
    strides = row_ids.stride()
    return (num_tokens * num_cols, num_cols, strides[0], strides[1], col_begin, col_end)


def row_tile_options(E: int, kernel: LookupKernelConfig) -> dict[str, Any]:
    """The constexprs of :func:`engramrt._jit.store_dequantized_rows`'s tile for rows of
    ``E`` values (:func:`tile_shape`) and the launch's warps, as launch keywords."""
    return _row_tile_options(E, kernel, interpreter_enabled())


def _row_tile_options(E: int, kernel: LookupKernelConfig, interpreted: bool) -> dict[str, Any]:
    blocks, blocks_pad, rows = tile_shape(E, kernel.rows_per_program)
    return {
        "E": E,
        "ROW_BYTES": E + blocks,
        "NB": blocks,
        "NB_PAD": blocks_pad,
        "ROWS": rows,
        "HW_CONVERT": kernel.resolved_hw_convert(interpreted),
        "num_warps": kernel.num_warps or DEFAULT_NUM_WARPS,
    }


def tiles_per_program(tiles: int, max_programs: int | None) -> int:
    """Consecutive tiles each program serves so that at most ``max_programs`` programs
    (about half as many at least) cover ``tiles``: a power of two, one compiled kernel
    per value."""
    if max_programs is None or tiles <= max_programs:
        return 1
    return _next_power_of_2(_cdiv(tiles, max_programs))


@triton.jit(do_not_specialize=["num_rows"])
def _gather_packed_kernel(
    row_ids_ptr,  # [U] int32 / int64, global row ids
    table_ptr,  # [num_rows, WORDS] words, packed rows
    out_ptr,  # [U, WORDS] words, contiguous
    n_rows,  # U
    row_begin,
    num_rows,  # rows of the table: ids outside [row_begin, row_begin + num_rows) copy zeros
    WORDS: tl.constexpr,
    WORDS_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    r, ok = program_block(n_rows, ROWS)
    row = tl.load(row_ids_ptr + r, mask=ok, other=0).to(tl.int64) - row_begin
    in_table = ok & (row >= 0) & (row < num_rows)
    row = tl.where(in_table, row, 0)
    word = tl.arange(0, WORDS_PAD)
    in_row = (word < WORDS)[None, :]
    words = tl.load(
        table_ptr + row[:, None] * WORDS + word[None, :], mask=in_table[:, None] & in_row, other=0
    )
    tl.store(out_ptr + r[:, None] * WORDS + word[None, :], words, mask=ok[:, None] & in_row)


def gather_packed_rows_triton(
    row_ids: torch.Tensor,
    table: Any,
    out: torch.Tensor,
    *,
    row_begin: int = 0,
    num_rows: int,
) -> torch.Tensor:
    """Copy packed rows ``table[row_ids - row_begin]`` into ``out`` (inputs validated by the caller).

    Args:
        row_ids: ``[U]`` int32/int64 global row ids on the compute device.
        table: packed rows viewed as words of :func:`word_dtype_for` its row
            bytes: a contiguous tensor, or an object with ``data_ptr()`` and
            that ``dtype`` readable by the device (host memory mapped for it).
        out: contiguous ``[U, row_bytes]`` uint8 on the compute device.
        num_rows: rows of ``table``; an id outside ``[row_begin, row_begin +
            num_rows)`` copies a row of zero bytes, read from nowhere.

    The bytes equal :func:`engramrt.lookup.reference.gather_packed_rows_reference`.
    """
    n_rows = row_ids.shape[0]
    if n_rows == 0:
        return out
    row_bytes = out.shape[1]
    word = word_dtype_for(row_bytes)
    words = row_bytes // torch.empty((), dtype=word).element_size()
    _gather_packed_kernel[(triton.cdiv(n_rows, GATHER_ROWS_PER_PROGRAM),)](
        row_ids,
        table,
        out.view(word),
        n_rows,
        row_begin,
        num_rows,
        WORDS=words,
        WORDS_PAD=triton.next_power_of_2(words),
        ROWS=GATHER_ROWS_PER_PROGRAM,
    )
    return out
