"""Do copy engines read a decode step's rows from host memory without slowing the blocks?

The runtime's GPU reads of host tables (the ``uva`` tier's kernel, and the ``host`` tier's
small batches) run on the multiprocessors beside the model's blocks; BENCHMARKS.md
("Step cost in every mode and loop") measured a 6,144-row read taking 44-49 us alone and
226-317 us beside the blocks, and the blocks slowed by it. Copy engines move memory
without a multiprocessor. This study times, on one GPU, medians over ``--reps``:

- ``blocks``: a loop of bf16 GEMMs standing for the blocks before an Engram layer, alone;
- the same loop with one read of ``--rows`` random rows (264 B each, from a pinned host
  table of ``--table-gib``) started beside it on a side stream, by
  - ``sm``: the ``uva`` tier's lookup kernel (rows dequantised to bf16, as served), and
  - ``ce``: ``cuMemcpyBatchAsync``, one 264 B copy per row into a staging buffer (the
    packed rows, not dequantised), with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``
    (a hint that discrete GPUs ignore), always on a stream of its own: the driver
    refuses the legacy default stream with ``CUDA_ERROR_INVALID_VALUE``;
- each read alone.

It reports the loop's slowdown with each read beside it and each read's time. A batch
copy cannot be captured in a CUDA graph (the driver has no graph node for it), so this
answers whether the lever is worth an eager/piecewise path, not a design.

    python bench/copy_engine_reads.py --out bench/results/copy-engine-reads-DATE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROW_BYTES = 264


def row_addresses(base: int, ids: np.ndarray, row_bytes: int = ROW_BYTES) -> list[int]:
    """The byte address of each row ``ids[i]`` of a table at ``base``."""
    return (base + ids.astype(np.int64) * row_bytes).tolist()


def _batch_copier(base: int, staging: torch.Tensor, ids: np.ndarray) -> Any:
    """A function that queues one batch copy of ``ids``' rows on a stream (or raises)."""
    from cuda.bindings import driver

    attr = driver.CUmemcpyAttributes()
    attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    pointer = driver.CUdeviceptr
    srcs = [pointer(a) for a in row_addresses(base, ids)]
    dsts = [pointer(a) for a in row_addresses(staging.data_ptr(), np.arange(len(ids)))]
    sizes = [ROW_BYTES] * len(ids)

    def copy(stream: torch.cuda.Stream) -> None:
        if stream.cuda_stream == 0:
            raise ValueError(
                "cuMemcpyBatchAsync refuses the legacy default stream (CUDA_ERROR_INVALID_VALUE);"
                " queue the batch on a stream of its own"
            )
        result = driver.cuMemcpyBatchAsync(
            dsts, srcs, sizes, len(ids), [attr], [0], 1, stream.cuda_stream
        )
        error = result[0] if isinstance(result, tuple) else result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync: {error}")

    return copy


def _timed(run: Any, reps: int) -> float:
    """Median milliseconds of ``run()`` (work queued on the current stream and others it
    joins), timed with events on the current stream."""
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6144, help="rows a read takes (decode 256)")
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--gemms", type=int, default=12, help="GEMMs in the blocks' loop")
    parser.add_argument("--gemm", default="2048,4096,4096", help="M,K,N of each GEMM")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_engine_reads: needs a CUDA device (none here)", file=sys.stderr)
        return 2
    from engramrt.bench.runner import environment
    from engramrt.lookup.tiers import TablePlacement, make_store

    device = torch.device("cuda", torch.cuda.current_device())
    num_rows = int(args.table_gib * 2**30) // ROW_BYTES
    store = make_store(TablePlacement("uva", device=device), num_rows=num_rows, E=256)
    table = store.device_rows()  # host memory mapped for the device (one address space)
    rng = np.random.default_rng(0)
    fill = torch.from_numpy(rng.integers(0, 120, (1 << 20, ROW_BYTES), dtype=np.uint8))
    for start in range(0, num_rows, fill.shape[0]):
        count = min(fill.shape[0], num_rows - start)
        store.write_rows(start, fill[:count])
    ids = rng.integers(0, num_rows, args.rows)
    row_ids = torch.from_numpy(ids).to(device).view(-1, 1).contiguous()  # [T, C = 1]
    staging = torch.empty((args.rows, ROW_BYTES), dtype=torch.uint8, device=device)
    m, k, n = (int(v) for v in args.gemm.split(","))
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)  # a batch copy needs a stream other than the default
    out = torch.empty((args.rows, 1, 256), dtype=torch.bfloat16, device=device)

    def blocks() -> None:
        for _ in range(args.gemms):
            torch.mm(a, b)

    def sm_read(stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            store.lookup(row_ids, out)

    copier = None
    note = ""
    try:
        copier = _batch_copier(int(table.data_ptr()), staging, ids)
        copier(side)
        torch.cuda.synchronize()
    except Exception as error:  # the driver, the bindings or the store may refuse
        copier, note = None, f"{type(error).__name__}: {error}"

    def alone(read: Any) -> Any:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            read(side)
            torch.cuda.current_stream().wait_stream(side)

        return run

    def beside(read: Any) -> Any:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            read(side)
            blocks()
            torch.cuda.current_stream().wait_stream(side)

        return run

    result: dict[str, Any] = {
        "environment": environment(device),
        "rows": args.rows,
        "row_bytes": ROW_BYTES,
        "table_gib": args.table_gib,
        "gemm": [m, k, n],
        "gemms": args.gemms,
        "reps": args.reps,
        "method": "CUDA events on the step's stream, median of reps after 2 warm-ups",
        "blocks_ms": _timed(blocks, args.reps),
        "sm_read_ms": _timed(lambda: sm_read(torch.cuda.current_stream()), args.reps),
        "blocks_with_sm_read_ms": _timed(beside(sm_read), args.reps),
        "ce_unavailable": note or None,
    }
    if copier is not None:
        copy = copier
        result["ce_read_ms"] = _timed(alone(copy), args.reps)
        result["blocks_with_ce_read_ms"] = _timed(beside(copy), args.reps)
        got = staging.cpu()
        want = store.gather_packed(torch.from_numpy(ids)).cpu()
        result["ce_rows_equal"] = bool(torch.equal(got, want))
    for key in ("sm", "ce"):
        if f"blocks_with_{key}_read_ms" in result:
            with_read = result[f"blocks_with_{key}_read_ms"]
            result[f"{key}_slowdown_pct"] = round(100 * (with_read / result["blocks_ms"] - 1), 2)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
