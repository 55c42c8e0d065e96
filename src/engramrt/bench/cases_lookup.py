"""Benchmark cases of the row lookup at DeepSeek-V4.1-Flash shapes, per storage tier.

``T`` tokens x ``C = 24`` hash columns of ``E = 256`` values, gathered from
a table of 8 GiB (1 GiB for ``quick``; a V4.1 layer is 94.4 GiB, so the
rows are spread far beyond any cache either way) of random packed rows:
random value bytes (the two e4m3fn NaN codes remapped so every result is
finite) and scale bytes in 110..135. Row ids are uniform, int32, as
hashing produces them.

- ``device-outside`` (T=8192): the device tier's lookup, the same launch,
  with 1/8 of the ids outside the table (read as rows of zeros, never
  out of bounds); timed against ``lookup/device/T=8192`` it shows what
  bounding every id costs.
- ``device`` tier: the Triton kernel (default settings, the
  integer-conversion variant, and at T=8192 the variants of
  :data:`DEVICE_RATE_SWEEP`, so one H200 run shows which is best) against
  ``torch-eager``,
  an ``index_select`` of packed rows followed by the reference dequantise,
  both on the GPU. Ceiling: device copy, ``rows * 264`` bytes read plus
  ``rows * E * 2`` written.
- ``uva``, ``host``, ``disk`` tiers: the tier's lookup (the host tier
  also with the CPU gathering every row, and at T=8192 with other shares of
  GPU reads and the gather settings of :data:`HOST_GATHER_SWEEP`; the uva
  and host tiers at T=256 with the kernel settings of
  :data:`DECODE_READ_SWEEP` for their reads of host memory) against
  ``torch-eager``, a plain CPU ``index_select`` of the packed rows, then
  ``.to('cuda')``, then the reference dequantise on the GPU. Ceiling:
  host-to-device copy of ``rows * 264`` bytes.
- ``disk``: the packed-row file is written to ``$ENGRAMRT_BENCH_DIR`` (default
  the temp dir), flushed and dropped from the page cache
  (``posix_fadvise(DONTNEED)``) before timing; the timed calls repeat the same
  ids, so after the first call the touched pages are in the page cache and
  the case measures the memory-mapped gather path, not the drive.

Every output is compared bit for bit with the baseline's (the reference)
before anything is timed.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from engramrt.bench.registry import (
    Case,
    Inputs,
    Tuning,
    bf16_bits_check,
    register,
    table_params,
)
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.settings import LookupKernelConfig
from engramrt.lookup.synthetic import random_packed_rows
from engramrt.packed import row_bytes_for, unpack_rows
from engramrt.quant import dequantize_rows_reference

E = 256
COLS = 24  # (N - 1) * H hash columns per layer
ROW_BYTES = row_bytes_for(E)  # 264
_FILL_ROWS = 1 << 22  # rows generated per piece when filling host and disk tables
_GPU_SHARES = (0.15, 0.3, 0.45)  # host tier: shares of the GPU's reads besides the default

_K = LookupKernelConfig

DECODE_READ_SWEEP: tuple[LookupKernelConfig, ...] = (
    # full grids (one tile per program): bytes in flight per program
    _K(8, 4),
    _K(16, 4),  # DEFAULT_KERNEL's tile (the uva tier's default before this sweep)
    _K(32, 8),
    _K(64, 16),
    _K(16, 4, cache_modifier=".cg"),
    # bounded grids: fewer requests in flight, each program's tiles in turn
    _K(32, 4, max_programs=16),  # HOST_READ_KERNEL
    _K(32, 4, max_programs=16, num_stages=1),
    _K(32, 4, max_programs=16, num_stages=4),
    _K(128, 16, max_programs=16),
    _K(32, 4, max_programs=24),
    _K(8, 1, max_programs=64),
    _K(16, 4, max_programs=64),
    _K(64, 8, max_programs=32),
    _K(8, 2, max_programs=132),  # UVA_KERNEL
    _K(8, 2, max_programs=132, num_stages=4),
    _K(16, 4, max_programs=132),
    _K(4, 2, max_programs=132),
    _K(8, 2, max_programs=264),
)
"""Lookup-kernel settings timed for the reads of host memory at T=256 (6,144 rows),
on the uva tier and the host tier's GPU reads. With ``engramrt bench
--write-config DIR`` the uva tier's fastest (graph replay) becomes its entry in
``DIR/lookup_rows.<device>.json``; the host tier's entry is chosen with its cost
to a model beside it (BENCHMARKS.md#what-keeping-the-tables-off-the-gpu-costs,
run E) and kept."""

DEVICE_RATE_SWEEP: tuple[LookupKernelConfig, ...] = (
    _K(8, 2),
    _K(8, 4),
    _K(32, 4),
    _K(32, 8),
    _K(16, 8),
    _K(64, 8),
    _K(32, 4, hw_convert=False),
    _K(16, 4, cache_modifier=".cg"),
    _K(32, 4, max_programs=1056),  # a persistent grid: 8 programs per SM
    _K(32, 8, max_programs=528, num_stages=3),
)
"""Lookup-kernel settings timed on the device tier at T=8192 (196,608 rows) beside
the default; the winner goes to :data:`engramrt.lookup.settings.DEFAULT_KERNEL`."""

HOST_GATHER_SWEEP: tuple[tuple[int, int | None, bool], ...] = (
    # (chunk_rows, num_threads, deduplicate)
    (16384, None, True),  # more, smaller pieces: a shorter last copy
    (32768, None, True),
    (131072, None, True),
    (196608, None, True),  # one piece: no overlap of gather and copy
    (32768, 8, True),
    (65536, 8, True),
    (65536, 16, True),
    (32768, 16, True),
    (65536, None, False),  # uniform ids repeat little: skip the sort on the GPU
    (32768, None, False),
)
"""Settings of the host tier's CPU gather timed at T=8192 beside the store's
defaults: ``chunk_rows`` (rows per gather-then-copy piece), ``num_threads`` (None:
the store's rule) and whether the batch is deduplicated (sorted and made unique
on the GPU first). The winners go to
:data:`engramrt.lookup.tiers.host_gather.DEFAULT_CHUNK_ROWS`,
:data:`~engramrt.lookup.tiers.host_gather.ROWS_PER_GATHER_THREAD` and
:data:`~engramrt.lookup.tiers.host_gather.DEDUP_MIN_ROWS`; none beat the defaults
(BENCHMARKS.md#decode-against-the-targets-2026-12-01): the time is in the stages,
not in these settings."""


def kernel_label(kernel: LookupKernelConfig) -> str:
    """``rows=32,warps=8,programs=16,stages=4,cg,hw``: the settings that differ from
    the defaults, for an implementation's name."""
    parts = [f"rows={kernel.rows_per_program}", f"warps={kernel.num_warps}"]
    if kernel.max_programs is not None:
        parts.append(f"programs={kernel.max_programs}")
    if kernel.num_stages is not None:
        parts.append(f"stages={kernel.num_stages}")
    if kernel.cache_modifier:
        parts.append(kernel.cache_modifier.lstrip("."))
    if kernel.hw_convert is not None:
        parts.append("hw" if kernel.hw_convert else "int")
    if not kernel.cached_launch:
        parts.append("plain-launch")
    return ",".join(parts)


# One store per tier, kept across the cases of a run (building 8 GiB tables
# is the slow part); a case with another table size replaces it.
_STORES: dict[str, tuple[tuple[int, str], Any]] = {}


def _bench_dir() -> Path:
    return Path(os.environ.get("ENGRAMRT_BENCH_DIR") or tempfile.gettempdir())


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _store(tier: str, num_rows: int, device: torch.device) -> Any:
    from engramrt.lookup.tiers import (
        DiskRowStore,
        RowStore,
        TablePlacement,
        make_store,
        tier_class,
    )

    key = (num_rows, str(device))
    cached = _STORES.get(tier)
    if cached is not None and cached[0] == key:
        return cached[1]
    _STORES.pop(tier, None)
    torch.cuda.empty_cache()
    generator = torch.Generator(device=device).manual_seed(1234)
    store: RowStore
    if tier == "disk":
        path = _bench_dir() / f"engramrt-bench-lookup-{os.getpid()}.rows"
        store = DiskRowStore(path, num_rows, E, create=True, device=device)
        weakref.finalize(store, path.unlink, missing_ok=True)
    else:
        options = tier_class(tier).options_type(backend="triton")  # type: ignore[call-arg]
        store = make_store(TablePlacement(options, device=device), num_rows=num_rows, E=E)
    for start in range(0, num_rows, _FILL_ROWS):  # generated on the GPU, in pieces
        count = min(_FILL_ROWS, num_rows - start)
        store.write_rows(start, random_packed_rows(count, E, device, generator))
    if tier == "disk":
        assert isinstance(store, DiskRowStore)
        store.flush()
        _drop_page_cache(store.path)
    _STORES[tier] = (key, store)
    return store


def _host_table(store: Any) -> torch.Tensor:
    """The CPU tensor of packed rows behind a host-side store (for the baseline)."""
    return store.source


def _make(
    tier: str, num_tokens: int, num_rows: int, outside_share: float = 0.0
) -> Callable[[torch.device], Inputs]:
    """Inputs of a case; ``outside_share`` of the ids (at random places) lie outside the
    table: below it, just past it and far past it, all read as rows of zeros."""

    def make(device: torch.device) -> Inputs:
        store = _store(tier, num_rows, device)
        row_ids = torch.randint(0, num_rows, (num_tokens, COLS), dtype=torch.int32, device=device)
        if outside_share:
            outside = torch.rand(row_ids.shape, device=device) < outside_share
            far = torch.tensor([-1, num_rows, 2**31 - 1], dtype=torch.int32, device=device)
            choice = torch.randint(0, 3, row_ids.shape, device=device)
            row_ids = torch.where(outside, far[choice], row_ids)
        return {
            "store": store,
            "row_ids": row_ids,
            # a fixed output address, so the capturable tiers can be graph-captured
            "out": torch.empty((num_tokens, COLS, E), dtype=torch.bfloat16, device=device),
        }

    return make


def _tier_lookup(inputs: Inputs) -> torch.Tensor:
    return inputs["store"].lookup(inputs["row_ids"], out=inputs["out"])


def _variant(kernel: LookupKernelConfig) -> Callable[[Inputs], torch.Tensor]:
    """The device-tier kernel with other settings, on the same table."""

    def run(inputs: Inputs) -> torch.Tensor:
        from engramrt.lookup import lookup_rows

        return lookup_rows(
            inputs["row_ids"],
            inputs["store"].table,
            backend="triton",
            kernel=kernel,
        )

    return run


def _store_variant(**settings: Any) -> Callable[[Inputs], Any]:
    """The store's lookup with some of its attributes (``kernel``, ``gpu_reads``,
    ``gpu_share``, ``chunk_rows``, ``num_threads``) set otherwise for the call."""

    def run(inputs: Inputs) -> torch.Tensor:
        store = inputs["store"]
        before = {name: getattr(store, name) for name in settings}
        for name, value in settings.items():
            setattr(store, name, value)
        try:
            return store.lookup(inputs["row_ids"], out=inputs["out"])
        finally:
            for name, value in before.items():
                setattr(store, name, value)

    return run


def _host_variant(gpu_reads: bool, gpu_share: float | None = None) -> Callable[[Inputs], Any]:
    """The host tier's lookup with GPU reads switched off, or another GPU share."""
    if gpu_share is None:
        return _store_variant(gpu_reads=gpu_reads)
    return _store_variant(gpu_reads=gpu_reads, gpu_share=gpu_share)


def _queued_lookup(inputs: Inputs) -> torch.Tensor:
    """The host tier's CPU gather queued in stream order (``HostOptions(gather="queued")``,
    no GPU reads) over the same rows, timed as one lookup."""
    from engramrt.distributed.stores import SharedRows
    from engramrt.lookup.tiers import HostGatherRowStore, HostOptions

    queued = inputs.get("queued")
    if queued is None:
        store = inputs["store"]
        queued = inputs["queued"] = HostGatherRowStore(
            store.num_rows,
            E,
            HostOptions(gather="queued", gpu_reads=False, backend="triton"),
            device=store.device,
            host_rows=SharedRows(store.source, owner=store),
        )
    return queued.lookup(inputs["row_ids"], out=inputs["out"])


def _device_torch_eager(inputs: Inputs) -> torch.Tensor:
    """index_select of packed rows, then the reference dequantise, on the GPU."""
    return lookup_rows_reference(inputs["row_ids"], inputs["store"].table, E)


def _host_torch_eager(inputs: Inputs) -> torch.Tensor:
    """CPU index_select of packed rows, ``.to('cuda')``, reference dequantise on the GPU."""
    row_ids = inputs["row_ids"]
    packed = _host_table(inputs["store"]).index_select(0, row_ids.cpu().reshape(-1).to(torch.int64))
    values, scales = unpack_rows(packed.to(row_ids.device))
    return dequantize_rows_reference(values, scales).reshape(*row_ids.shape, E)


# Every implementation's bf16 bits equal the reference's.
_check = bf16_bits_check("torch-eager")


@register
def lookup_cases(quick: bool) -> list[Case]:
    table_bytes = (1 if quick else 8) << 30
    num_rows = table_bytes // ROW_BYTES + 1  # at least table_bytes
    cases = []
    for tier in ("device", "uva", "host", "disk"):
        for num_tokens in (256, 8192):
            rows = num_tokens * COLS
            tuning: Tuning | None = None
            impls: dict[str, Callable[[Inputs], Any]]
            ceiling: Literal["d2d", "h2d"]
            if tier == "device":
                impls = {
                    "triton": _tier_lookup,
                    "triton[int convert]": _variant(LookupKernelConfig(hw_convert=False)),
                    "torch-eager": _device_torch_eager,
                }
                if num_tokens == 8192:
                    for kernel in DEVICE_RATE_SWEEP:
                        impls[f"triton[{kernel_label(kernel)}]"] = _variant(kernel)
                bytes_moved, ceiling = rows * ROW_BYTES + rows * E * 2, "d2d"
            else:
                impls = {tier: _tier_lookup, "torch-eager": _host_torch_eager}
                if tier == "host" and torch.cuda.is_available():
                    impls["host[cpu gather]"] = _host_variant(gpu_reads=False)
                    impls["host[queued gather]"] = _queued_lookup
                    if num_tokens == 8192:
                        for share in _GPU_SHARES:
                            impls[f"host[gpu_share={share}]"] = _host_variant(True, share)
                        for chunk_rows, num_threads, dedup in HOST_GATHER_SWEEP:
                            name = (
                                f"host[cpu gather,chunk={chunk_rows},threads={num_threads}"
                                f"{'' if dedup else ',no dedup'}]"
                            )
                            impls[name] = _store_variant(
                                gpu_reads=False,
                                chunk_rows=chunk_rows,
                                num_threads=num_threads,
                                # 0: always deduplicate; past any batch: never
                                dedup_min_rows=0 if dedup else 1 << 62,
                            )
                if tier in ("uva", "host") and num_tokens == 256:
                    sweep = {f"{tier}[{kernel_label(k)}]": k for k in DECODE_READ_SWEEP}
                    for name, kernel in sweep.items():
                        impls[name] = _store_variant(kernel=kernel)
                    if tier == "uva":
                        # The host tier's entry is chosen by its cost to a model running
                        # beside it (bench/runtime_overhead.py), not by this case alone.
                        tuning = Tuning(
                            kernel="lookup_rows",
                            key_fields=("tier",),
                            match={"tier": "uva"},
                            configs=sweep,
                            measured="BENCHMARKS.md#decode-against-the-targets-2026-12-01",
                        )
                bytes_moved, ceiling = rows * ROW_BYTES, "h2d"
            # The host tier's GPU reads of a decode batch need no host synchronisation.
            capturable = tier in ("device", "uva") or (tier == "host" and num_tokens == 256)
            graph_impls = tuple(
                name
                for name in impls
                if name not in ("torch-eager", "host[cpu gather]", "host[queued gather]")
            )
            cases.append(
                Case(
                    name=f"lookup/{tier}/T={num_tokens}",
                    params={
                        "tier": tier,
                        "T": num_tokens,
                        **table_params(num_rows, E, COLS),
                        "ids": "uniform int32",
                    },
                    make=_make(tier, num_tokens, num_rows),
                    impls=impls,
                    check=_check,
                    bytes_moved=bytes_moved,
                    items=rows,
                    item_name="rows",
                    ceiling=ceiling,
                    graph=capturable,
                    graph_impls=graph_impls,
                    tuning=tuning,
                )
            )
    rows = 8192 * COLS
    cases.append(
        Case(
            name="lookup/device-outside/T=8192",
            params={
                "tier": "device",
                "T": 8192,
                **table_params(num_rows, E, COLS),
                "ids": "uniform int32, 1/8 outside the table",
            },
            make=_make("device", 8192, num_rows, outside_share=0.125),
            impls={"triton": _tier_lookup, "torch-eager": _device_torch_eager},
            check=_check,
            bytes_moved=rows * ROW_BYTES + rows * E * 2,
            items=rows,
            item_name="rows",
            graph=True,
        )
    )
    return cases
