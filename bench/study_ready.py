"""What a table's time to ready is made of on this host (run on a GPU machine).

    python bench/study_ready.py [--gib 16] [--dir /dev/shm] [--threads 16] [--out PATH]

On one ``--gib`` file in ``--dir`` (a tmpfs such as ``/dev/shm``), each
stage of making a shared table ready, timed alone, with the alternatives
beside it:

- reserving the bytes: ``posix_fallocate`` in one thread, against a sparse
  file (``ftruncate``) whose pages ``--threads`` threads first-touch;
- filling it with synthetic rows computed on the GPU
  (:func:`~engramrt.distributed.fill.fill_synthetic_rows`): through pinned
  staging and CPU copies (``copy="staged"``), against copies from the GPU
  straight into the mapping registered for CUDA (``copy="direct"``), on the
  allocated file and on a sparse one;
- registering the mapping for CUDA (``cudaHostRegister``): whole, in one
  call, against pieces registered by several threads at once (the device
  reads each registered byte at its host address on this machine, so
  pieces serve a kernel as one range: checked bit for bit across piece
  boundaries), on the writable mapping and on a fresh read-only one (what
  an attacher registers), and the unregistration.

Prints one line per stage and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engramrt.bench.runner import environment
from engramrt.distributed.fill import fill_synthetic_rows
from engramrt.lookup.mapped import MappedHostRows, gather_mapped_rows
from engramrt.packed import row_bytes_for, word_dtype_for

E = 256
ROW_BYTES = row_bytes_for(E)
PORTABLE, MAPPED, READ_ONLY = 0x01, 0x02, 0x08


def split(count: int, parts: int) -> list[tuple[int, int]]:
    step = -(-count // parts)
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


def mapping(path: Path, nbytes: int, *, writable: bool) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    flat = torch.frombuffer(region, dtype=torch.uint8) if writable else None
    if flat is None:  # a read-only buffer: torch warns but reads it
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(region, dtype=torch.uint8)
    return region, flat


def sparse_mapping(path: Path, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A new sparse file of ``nbytes`` (no page allocated yet), mapped writable."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return mapping(path, nbytes, writable=True)


def register(rows: torch.Tensor, pieces: int, flags: int, threads: int) -> list[tuple[int, int]]:
    """Register ``rows`` in ``pieces`` byte ranges from up to ``threads`` threads."""
    base, nbytes = rows.data_ptr(), rows.numel()
    page = 1 << 21  # piece bounds on 2 MiB so no page is in two registrations
    step = -(-nbytes // pieces // page) * page
    ranges = [(base + lo, min(nbytes, lo + step) - lo) for lo in range(0, nbytes, step)]
    cudart = torch.cuda.cudart()

    def one(span: tuple[int, int]) -> None:
        status = int(cudart.cudaHostRegister(span[0], span[1], flags))
        if status:
            raise RuntimeError(f"cudaHostRegister({span}) = {status}")

    with ThreadPoolExecutor(min(threads, len(ranges))) as pool:
        list(pool.map(one, ranges))
    return ranges


def unregister(ranges: list[tuple[int, int]], threads: int) -> None:
    cudart = torch.cuda.cudart()
    with ThreadPoolExecutor(min(threads, len(ranges))) as pool:
        list(pool.map(lambda span: cudart.cudaHostUnregister(span[0]), ranges))


def timed(what: str, fn: Callable[[], object], lines: list[dict], nbytes: int) -> object:
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    lines.append({"stage": what, "s": seconds, "GB/s": nbytes / seconds / 1e9})
    print(f"{what:64s} {seconds:8.3f} s {nbytes / seconds / 1e9:7.2f} GB/s", flush=True)
    return result


def check_across_pieces(
    rows: torch.Tensor, ranges: list[tuple[int, int]], device: torch.device
) -> bool:
    """The device reads rows on both sides of every piece boundary as the host holds them."""
    num_rows = rows.shape[0]
    ids = [0, num_rows - 1]
    for address, _size in ranges[1:]:
        boundary = (address - rows.data_ptr()) // ROW_BYTES
        ids += [max(0, boundary - 1), boundary, min(num_rows - 1, boundary + 1)]
    ids_t = torch.tensor(ids, dtype=torch.int64)
    mapped = MappedHostRows(rows.data_ptr(), num_rows, word_dtype_for(ROW_BYTES))
    found = gather_mapped_rows(ids_t.to(device), mapped, ROW_BYTES, device).cpu()
    return bool(torch.equal(found, rows[ids_t]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # the context, outside every timing
    num_rows = int(args.gib * 2**30) // ROW_BYTES
    nbytes = num_rows * ROW_BYTES
    lines: list[dict] = []
    threads = args.threads
    path = Path(args.dir) / f"engramrt-study-ready-{os.getpid()}"
    report = {"gib": args.gib, "rows": num_rows, "threads": threads, "dir": args.dir}
    try:
        # 1. Reserving: fallocate in one thread, then the loaders' fill through staging.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        timed(
            "reserve: posix_fallocate, one thread",
            lambda: os.posix_fallocate(fd, 0, nbytes),
            lines,
            nbytes,
        )
        os.close(fd)
        region, flat = mapping(path, nbytes, writable=True)
        rows = flat.view(num_rows, ROW_BYTES)
        timed(
            "fill: GPU compute, pinned staging, CPU copies (allocated file)",
            lambda rows=rows: fill_synthetic_rows(rows, E, num_threads=threads, device=device),
            lines,
            nbytes,
        )
        sample = rows[:: max(1, num_rows // 4096)].clone()
        report["meminfo_filled"] = {
            key: value
            for key, value in (line.split(":", 1) for line in open("/proc/meminfo"))
            if key.startswith("Shmem")
        }
        print(f"after the fill: {report['meminfo_filled']}")
        # 2. Registration of the writable mapping: whole, then in pieces.
        for pieces, workers in ((1, 1), (threads, threads), (4 * threads, threads)):
            ranges = timed(
                f"register writable, {pieces} pieces on {workers} threads (resident pages)",
                lambda pieces=pieces, workers=workers, rows=rows: register(
                    rows, pieces, PORTABLE | MAPPED, workers
                ),
                lines,
                nbytes,
            )
            if pieces > 1:
                report[f"read_across_{pieces}_pieces"] = check_across_pieces(rows, ranges, device)
                print(
                    f"device reads across {pieces} pieces: {report[f'read_across_{pieces}_pieces']}"
                )
            timed(
                f"unregister {pieces} pieces",
                lambda ranges=ranges: unregister(ranges, threads),
                lines,
                nbytes,
            )
        # 3. Filling straight from the GPU into the mapping, registered by the fill.
        timed(
            "fill: copy='direct' (register in pieces, GPU copies, unregister), allocated file",
            lambda rows=rows: fill_synthetic_rows(rows, E, device=device, copy="direct"),
            lines,
            nbytes,
        )
        report["direct_fill_matches"] = bool(torch.equal(rows[:: max(1, num_rows // 4096)], sample))
        print(f"direct fill matches the staged fill: {report['direct_fill_matches']}")
        del rows, flat
        region.close()
        # 4. A fresh read-only mapping, as an attacher registers it.
        region, flat = mapping(path, nbytes, writable=False)
        rows = flat.view(num_rows, ROW_BYTES)
        for pieces, workers in ((1, 1), (threads, threads)):
            ranges = timed(
                f"register read-only mapping, {pieces} pieces on {workers} threads",
                lambda pieces=pieces, workers=workers, rows=rows: register(
                    rows, pieces, PORTABLE | MAPPED | READ_ONLY, workers
                ),
                lines,
                nbytes,
            )
            unregister(ranges, threads)
        del rows, flat
        region.close()
        path.unlink()
        # 5. A sparse file: first touch in parallel, or by the registration itself.
        region, flat = sparse_mapping(path, nbytes)
        rows = flat.view(num_rows, ROW_BYTES)

        def touch(flat: torch.Tensor = flat) -> None:
            torch.set_num_threads(1)
            with ThreadPoolExecutor(threads) as pool:
                list(
                    pool.map(
                        lambda span: flat[span[0] : span[1] : 4096].fill_(0), split(nbytes, threads)
                    )
                )
            torch.set_num_threads(threads)

        timed(f"reserve: sparse file, first touch on {threads} threads", touch, lines, nbytes)
        del rows, flat
        region.close()
        path.unlink()
        region, flat = sparse_mapping(path, nbytes)
        rows = flat.view(num_rows, ROW_BYTES)
        timed(
            "reserve+fill: sparse file, copy='direct' (the registration first-touches)",
            lambda rows=rows: fill_synthetic_rows(rows, E, device=device, copy="direct"),
            lines,
            nbytes,
        )
        report["sparse_direct_fill_matches"] = bool(
            torch.equal(rows[:: max(1, num_rows // 4096)], sample)
        )
        del rows, flat
        region.close()
    finally:
        path.unlink(missing_ok=True)
    report["stages"] = lines
    report["environment"] = environment(device)
    print(json.dumps({k: v for k, v in report.items() if k != "stages"}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
