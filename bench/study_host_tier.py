"""What limits the host-gather tier (run on a GPU machine).

    python bench/study_host_tier.py [--table-gib 8] [--sections all] [--out report.json]

For 196,608 random rows (T = 8,192 tokens x 24 columns) of 264 bytes from a
host table (default 8 GiB) it times each stage separately: unique on the GPU,
the ids to the host, CPU gathers by method and thread count, the pinned
host-to-device copy, and the whole HostGatherRowStore lookup with its
settings. Prints one line per measurement. ``--sections`` picks among
``stages`` (unique and the ids' trip to the host), ``dedup`` (the store's lookup
with and without deduplication, over piece sizes, for uniform and Zipf ids), ``decode``
(a decode step's first layer from the CPU: host hash, gather, copy, lookup), ``methods`` (CPU gathers by
method and thread count, the pinned copy), ``hugepages``, ``store`` (the
store's lookup over chunk sizes and thread counts), ``profile`` (one lookup
stage by stage), ``pieces`` (gather-then-copy pieces by size: the gathers
alone, the copies alone, and both with the copy stream entered per piece or
once), ``overlap`` (the CPU gather and the pinned copy alone and at
the same time: whether the host's memory lets them overlap) and ``groups``
(the lookup split into token groups, each deduplicated, gathered, copied and
dequantised in turn, so that one group's stages overlap another's).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engramrt.bench.runner import environment, median_seconds
from engramrt.lookup.tiers import HostOptions, TablePlacement, make_store
from engramrt.lookup.tiers.host_gather import DEFAULT_CHUNK_ROWS

ROW = 264


def timed(fn, reps: int = 5) -> float:
    """Median seconds of ``reps`` calls, each to the end of its device work."""
    return median_seconds(fn, reps, warmup=1, sync=torch.cuda.synchronize)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--sections", default="stages,methods,hugepages,store")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    gib = args.table_gib
    rows = int(gib * 2**30) // ROW
    torch.manual_seed(0)
    src = torch.empty((rows, ROW), dtype=torch.uint8)
    src.view(-1)[: rows * ROW // 8 * 8].view(torch.int64).random_()
    device = torch.device("cuda")
    n = 8192 * 24
    ids_dev = torch.randint(0, rows, (n,), device=device)
    report = []
    records = []

    def line(label: str, seconds: float, count: int = n) -> None:
        text = f"{label:58s} {seconds * 1e3:8.3f} ms {count / seconds / 1e6:8.1f} M rows/s"
        report.append(text)
        records.append({"label": label, "ms": seconds * 1e3, "rows": count})
        print(text, flush=True)

    print(f"torch threads {torch.get_num_threads()}, cpus {len(os.sched_getaffinity(0))}")
    uniq = torch.unique(ids_dev, sorted=True, return_inverse=True)
    if "stages" in sections:
        line(
            "torch.unique(sorted, inverse) on GPU",
            timed(lambda: torch.unique(ids_dev, sorted=True, return_inverse=True)),
        )
        line("unique ids to host (.cpu())", timed(lambda: uniq[0].cpu()))
    ids = uniq[0].cpu()
    u = ids.shape[0]
    ids_np = ids.numpy()
    src_np = src.numpy()
    src_void = src_np.view(np.dtype((np.void, ROW))).reshape(-1)
    src_i64 = src.view(torch.int64)
    pinned = torch.empty((u, ROW), dtype=torch.uint8, pin_memory=True)
    pinned_void = pinned.numpy().view(np.dtype((np.void, ROW))).reshape(-1)
    pinned_i64 = pinned.view(torch.int64)
    dev_rows = torch.empty((u, ROW), dtype=torch.uint8, device=device)
    if "profile" in sections:
        profile_store(src, rows, ids_dev, line)
    if "store" in sections:
        study_store(src, rows, ids_dev, line)
    if "overlap" in sections:
        study_overlap(src_i64, ids, pinned, dev_rows, line)
    if "pieces" in sections:
        study_pieces(src_i64, ids, pinned, dev_rows, line)
    if "groups" in sections:
        study_groups(src, rows, ids_dev, line)
    if "dedup" in sections:
        study_dedup(src, rows, device, line)
    if "decode" in sections:
        study_decode(src, rows, device, line)
    if "methods" not in sections:
        finish(args, report, records)
        return

    methods = {
        "torch.index_select uint8 [N,264]": lambda lo, hi: torch.index_select(
            src, 0, ids[lo:hi], out=pinned[lo:hi]
        ),
        "torch.index_select int64 [N,33]": lambda lo, hi: torch.index_select(
            src_i64, 0, ids[lo:hi], out=pinned_i64[lo:hi]
        ),
        "numpy take void264": lambda lo, hi: np.take(
            src_void, ids_np[lo:hi], out=pinned_void[lo:hi]
        ),
    }
    for threads in (1, 4, 8, 16):
        torch.set_num_threads(1)
        pool = ThreadPoolExecutor(threads)
        bounds = [u * k // threads for k in range(threads + 1)]
        for name, fn in methods.items():

            def run(fn=fn) -> None:
                list(pool.map(lambda b: fn(*b), zip(bounds[:-1], bounds[1:])))

            line(f"gather {name}, {threads} threads", timed(run), u)
        pool.shutdown()
    line(
        "pinned -> device copy of the unique rows",
        timed(lambda: dev_rows.copy_(pinned, non_blocking=True)),
        u,
    )
    for threads in (8, 16):
        torch.set_num_threads(threads)
        line(
            f"one index_select int64, {threads} intra-op threads",
            timed(lambda: torch.index_select(src_i64, 0, ids, out=pinned_i64)),
            u,
        )
    torch.set_num_threads(1)
    if "hugepages" not in sections:
        finish(args, report, records)
        return

    study_hugepages(src, ids, pinned, dev_rows, line)
    finish(args, report, records)


def study_hugepages(src, ids, pinned, dev_rows, line) -> None:
    """The gather from the same table in transparent huge pages, and the gather pipelined
    with the copy to the device, from either table."""
    rows, u = src.shape[0], ids.shape[0]
    src_i64, pinned_i64 = src.view(torch.int64), pinned.view(torch.int64)
    # The same table in transparent huge pages (anonymous mmap + MADV_HUGEPAGE).
    import mmap

    region = mmap.mmap(-1, rows * ROW, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    huge = torch.frombuffer(region, dtype=torch.uint8).view(rows, ROW)
    huge.copy_(src)
    huge_i64 = huge.view(torch.int64)
    print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), flush=True)
    for threads in (8, 16):
        pool = ThreadPoolExecutor(threads)
        bounds = [u * k // threads for k in range(threads + 1)]

        def run_huge(pool=pool, bounds=bounds) -> None:
            list(
                pool.map(
                    lambda b: torch.index_select(
                        huge_i64, 0, ids[b[0] : b[1]], out=pinned_i64[b[0] : b[1]]
                    ),
                    zip(bounds[:-1], bounds[1:]),
                )
            )

        line(f"gather int64 from huge pages, {threads} threads", timed(run_huge), u)

        def pipeline(pool=pool, threads=threads, table=src_i64, pieces=4) -> None:
            stream = torch.cuda.Stream()
            edges = [u * k // pieces for k in range(pieces + 1)]
            for lo, hi in zip(edges[:-1], edges[1:]):
                b = [lo + (hi - lo) * k // threads for k in range(threads + 1)]
                list(
                    pool.map(
                        lambda x: torch.index_select(
                            table, 0, ids[x[0] : x[1]], out=pinned_i64[x[0] : x[1]]
                        ),
                        zip(b[:-1], b[1:]),
                    )
                )
                with torch.cuda.stream(stream):
                    dev_rows[lo:hi].copy_(pinned[lo:hi], non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)

        for pieces in (1, 2, 4, 8):
            line(
                f"pipeline gather+copy, {threads} threads, {pieces} pieces",
                timed(lambda pieces=pieces: pipeline(pieces=pieces)),
                u,
            )
            line(
                f"pipeline gather+copy (huge pages), {threads} threads, {pieces} pieces",
                timed(lambda pieces=pieces: pipeline(pieces=pieces, table=huge_i64)),
                u,
            )
        pool.shutdown()


def study_store(src, rows, ids_dev, line) -> None:
    """The store's whole lookup, over chunk sizes and thread counts."""
    row_ids = ids_dev.view(8192, 24).to(torch.int32)
    device = ids_dev.device
    settings = [(None, c) for c in (16384, 32768, DEFAULT_CHUNK_ROWS, 131072, 1 << 20)]
    settings += [(t, DEFAULT_CHUNK_ROWS) for t in (8, 12)]
    for threads, chunk in settings:
        options = HostOptions(num_threads=threads, chunk_rows=chunk, gpu_reads=False)
        store = make_store(TablePlacement(options, device), num_rows=1, E=256)
        store.source, store.num_rows = src, rows  # share the filled table, no second copy
        line(
            f"HostGatherRowStore.lookup threads={threads} chunk={chunk}",
            timed(lambda store=store: store.lookup(row_ids)),
        )
        del store
    decode_ids = row_ids[:256]
    for threads in (None, 1, 2, 4):
        options = HostOptions(num_threads=threads, gpu_reads=False)
        store = make_store(TablePlacement(options, device), num_rows=1, E=256)
        store.source, store.num_rows = src, rows
        line(
            f"HostGatherRowStore.lookup T=256 threads={threads}",
            timed(lambda store=store: store.lookup(decode_ids)),
            decode_ids.numel(),
        )
        del store


def study_dedup(src, rows, device, line) -> None:
    """The store's lookup of 8,192 tokens with deduplication and without (gathered as
    they come, each piece dequantised as it lands), over piece sizes, for uniform and
    Zipf ids, in interleaved rounds (host timings drift between runs: compare within
    one round)."""
    from engramrt.bench.cases_cache import ZipfRows

    shapes = {
        "uniform": torch.randint(0, rows, (8192, 24), device=device, dtype=torch.int32),
        "zipf": ZipfRows(rows, 1.0, device, seed=99).sample((8192, 24)),
    }
    settings = [(True, DEFAULT_CHUNK_ROWS)] + [(False, c) for c in (16384, 32768, 65536, 131072)]
    stores = {}
    for dedup, chunk in settings:
        options = HostOptions(chunk_rows=chunk, gpu_reads=False, dedup=dedup)
        store = make_store(TablePlacement(options, device), num_rows=1, E=256)
        store.source, store.num_rows = src, rows  # share the filled table, no second copy
        stores[(dedup, chunk)] = store
    times: dict[tuple, list[float]] = {}
    for _round in range(5):
        for ids_name, row_ids in shapes.items():
            for key, store in stores.items():
                times.setdefault((ids_name, *key), []).append(
                    timed(lambda store=store, row_ids=row_ids: store.lookup(row_ids), reps=5)
                )
    for (ids_name, dedup, chunk), values in times.items():
        label = f"lookup T=8192 {ids_name} dedup={dedup} chunk={chunk} (median of 5 rounds)"
        line(label, sorted(values)[len(values) // 2])


def study_decode(src, rows, device, line) -> None:
    """A decode step's first Engram layer from the CPU (256 tokens x 24 columns): the
    host hash of one layer from the step's host copy, the gather of its rows alone, their
    pinned copy alone, and the store's whole lookup of ids given on the host (the
    ``host_ids`` path: gather, copy, dequantise; the device drained after each), medians
    of 50 calls."""
    from engramrt.config import PRESETS
    from engramrt.hashing import HashBatch, HashConstants, hash_batch_host
    from engramrt.tokenmap import TokenMap

    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_config(PRESETS["dsv41-flash"], token_map)
    rng = np.random.default_rng(5)
    tokens = 256
    batch = HashBatch(
        input_ids=torch.from_numpy(rng.integers(0, token_map.vocab_size, tokens)),
        positions=torch.from_numpy(rng.integers(100, 1000, tokens)),
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32),
        lookback_token_ids=torch.from_numpy(rng.integers(0, token_map.vocab_size, (tokens, 3))),
    )
    count = tokens * 24

    def host_timed(fn, reps: int = 200) -> float:
        return median_seconds(fn, reps, warmup=10)

    line(
        "decode T=256 hash one layer on the host (numpy)",
        host_timed(lambda: hash_batch_host(batch, consts, token_map.map, [0])),
        count,
    )
    row_ids = torch.randint(0, rows, (tokens, 24), dtype=torch.int64)
    flat = row_ids.reshape(-1)
    words = src.view(torch.int64)
    pinned = torch.empty((count, ROW), dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty((count, ROW), dtype=torch.uint8, device=device)
    torch.set_num_threads(1)
    line(
        "decode T=256 gather 6,144 rows, 1 thread",
        host_timed(lambda: torch.index_select(words, 0, flat, out=pinned.view(torch.int64))),
        count,
    )
    line(
        "decode T=256 pinned copy of 6,144 rows",
        timed(lambda: on_device.copy_(pinned, non_blocking=True), reps=50),
        count,
    )
    store = make_store(TablePlacement(HostOptions(gpu_reads=False), device), num_rows=1, E=256)
    store.source, store.num_rows = src, rows  # share the filled table, no second copy
    out = torch.empty((tokens, 24, 256), dtype=torch.bfloat16, device=device)
    line(
        "decode T=256 store lookup of ids on the host",
        timed(lambda: store.lookup(row_ids, out), reps=50),
        count,
    )
    line(
        "decode T=256 store lookup of ids on the device (CPU gather)",
        timed(lambda: store.lookup(row_ids.to(device), out), reps=50),
        count,
    )
    torch.set_num_threads(len(os.sched_getaffinity(0)))


def study_overlap(src_i64, ids, pinned, dev_rows, line) -> None:
    """The gather into pinned memory and the pinned copy to the device, alone and together.

    Together: the copy of one full buffer runs on a side stream while the CPU
    gathers the same rows into a second buffer. Were the host's memory not
    shared, together would take the longer of the two alone."""
    u = ids.shape[0]
    second = torch.empty_like(pinned)
    second_i64 = second.view(torch.int64)
    stream = torch.cuda.Stream()
    torch.set_num_threads(len(os.sched_getaffinity(0)))

    def gather() -> None:
        torch.index_select(src_i64, 0, ids, out=second_i64)

    def copy() -> None:
        with torch.cuda.stream(stream):
            dev_rows.copy_(pinned, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    def both() -> None:
        with torch.cuda.stream(stream):
            dev_rows.copy_(pinned, non_blocking=True)
        gather()
        torch.cuda.current_stream().wait_stream(stream)

    shuffled = ids[torch.randperm(u)]
    line("overlap: gather alone (sorted ids)", timed(gather, 9), u)
    line(
        "overlap: gather alone (ids unsorted)",
        timed(lambda: torch.index_select(src_i64, 0, shuffled, out=second_i64), 9),
        u,
    )
    line("overlap: pinned copy alone", timed(copy, 9), u)
    line("overlap: gather and copy at once", timed(both, 9), u)
    torch.set_num_threads(1)


def study_pieces(src_i64, ids, pinned, dev_rows, line) -> None:
    """Gather-then-copy in pieces of several sizes, the way the store pipelines them."""
    u = ids.shape[0]
    pinned_i64 = pinned.view(torch.int64)
    stream = torch.cuda.Stream()
    torch.set_num_threads(len(os.sched_getaffinity(0)))

    def spans(chunk: int) -> list[tuple[int, int]]:
        return [(lo, min(u, lo + chunk)) for lo in range(0, u, chunk)]

    def gathers(chunk: int) -> None:
        for lo, hi in spans(chunk):
            torch.index_select(src_i64, 0, ids[lo:hi], out=pinned_i64[lo:hi])

    def copies(chunk: int) -> None:
        with torch.cuda.stream(stream):
            for lo, hi in spans(chunk):
                dev_rows[lo:hi].copy_(pinned[lo:hi], non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    def stream_per_piece(chunk: int) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        for lo, hi in spans(chunk):
            torch.index_select(src_i64, 0, ids[lo:hi], out=pinned_i64[lo:hi])
            with torch.cuda.stream(stream):
                dev_rows[lo:hi].copy_(pinned[lo:hi], non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    def stream_once(chunk: int) -> None:
        compute = torch.cuda.current_stream()
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for lo, hi in spans(chunk):
                torch.index_select(src_i64, 0, ids[lo:hi], out=pinned_i64[lo:hi])
                dev_rows[lo:hi].copy_(pinned[lo:hi], non_blocking=True)
        compute.wait_stream(stream)

    for chunk in (8192, 16384, 32768, 65536, u):
        for name, fn in (
            ("gathers alone", gathers),
            ("copies alone", copies),
            ("gather+copy, stream entered per piece", stream_per_piece),
            ("gather+copy, stream entered once", stream_once),
        ):
            line(f"pieces of {chunk}: {name}", timed(lambda fn=fn, c=chunk: fn(c), 9), u)
    torch.set_num_threads(1)


def study_groups(src, rows, ids_dev, line) -> None:
    """The lookup in token groups: group g's unique and ids' trip to the host, then
    its gather, copy and dequantise, while the device still copies and dequantises
    group g - 1 (``threaded``: a second thread deduplicates the next groups
    while the first gathers)."""
    import queue

    from engramrt.lookup import lookup_rows

    device = ids_dev.device
    row_ids = ids_dev.view(8192, 24).to(torch.int32)
    tokens, cols = row_ids.shape
    n = tokens * cols
    src_i64 = src.view(torch.int64)
    staging = torch.empty((n, ROW), dtype=torch.uint8, pin_memory=True)
    staged = staging.view(torch.int64)
    host_ids = torch.empty(n, dtype=torch.int32, pin_memory=True)
    copy_stream = torch.cuda.Stream()
    helper = ThreadPoolExecutor(1)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    store = make_store(TablePlacement(HostOptions(gpu_reads=False), device), num_rows=1, E=256)
    store.source, store.num_rows = src, rows
    reference = store.lookup(row_ids)

    def grouped(out: torch.Tensor, groups: int, threaded: bool) -> torch.Tensor:
        compute = torch.cuda.current_stream()
        edges = [tokens * k // groups for k in range(groups + 1)]
        spans = list(zip(edges[:-1], edges[1:]))
        ready: queue.Queue = queue.Queue()

        def dedup(t0: int, t1: int) -> tuple:
            unique, inverse = torch.unique(row_ids[t0:t1], sorted=True, return_inverse=True)
            ids = host_ids[t0 * cols : t0 * cols + unique.numel()]
            ids.copy_(unique, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            return t0, t1, ids, inverse

        def produce() -> None:
            with torch.cuda.stream(compute):
                for span in spans:
                    ready.put(dedup(*span))

        pending = helper.submit(produce) if threaded else None
        copy_stream.wait_stream(compute)
        for span in spans:
            t0, t1, ids, inverse = ready.get() if threaded else dedup(*span)
            base, count = t0 * cols, ids.numel()
            torch.index_select(src_i64, 0, ids, out=staged[base : base + count])
            packed = torch.empty((count, ROW), dtype=torch.uint8, device=device)
            with torch.cuda.stream(copy_stream):
                packed.copy_(staging[base : base + count], non_blocking=True)
            compute.wait_stream(copy_stream)
            packed.record_stream(copy_stream)
            lookup_rows(inverse, packed, out=out[t0:t1], backend="triton")
        if pending is not None:
            pending.result()
        return out

    line("groups: HostGatherRowStore.lookup", timed(lambda: store.lookup(row_ids)))
    for groups, threaded in ((1, False), (2, False), (3, False), (3, True), (6, False)):
        out = torch.zeros_like(reference)
        grouped(out, groups, threaded)
        assert torch.equal(out.view(torch.int16), reference.view(torch.int16)), groups
        label = f"groups: {groups} token groups{', threaded' if threaded else ''}"
        line(label, timed(lambda out=out, g=groups, t=threaded: grouped(out, g, t)))
    helper.shutdown()
    torch.set_num_threads(1)


def profile_store(src, rows, ids_dev, line) -> None:
    """Where one lookup's time goes: each phase alone, then step by step."""
    device = ids_dev.device
    for tokens in (256, 8192):
        row_ids = ids_dev.view(8192, 24)[:tokens].to(torch.int32).contiguous()
        count = row_ids.numel()
        store = make_store(TablePlacement(HostOptions(gpu_reads=False), device), num_rows=1, E=256)
        store.source, store.num_rows = src, rows
        flat = row_ids.reshape(-1)
        line(
            f"T={tokens} phase torch.unique + .cpu()",
            timed(lambda: torch.unique(flat.long(), sorted=True, return_inverse=True)[0].cpu()),
            count,
        )
        ids = torch.unique(flat).cpu()
        for dtype in (torch.int32, torch.int64):
            for threads in (1, 4, 16):
                store.num_threads = threads
                local = ids.to(dtype)
                line(
                    f"T={tokens} phase gather+copy {dtype} threads={threads}",
                    timed(lambda local=local: store._gather_to_device(local)),
                    count,
                )
        store.num_threads = None
        line(f"T={tokens} whole lookup", timed(lambda: store.lookup(row_ids)), count)
        breakdown(store, row_ids)


def breakdown(store, row_ids) -> None:
    """The store's lookup step by step, the device drained after each (median of 7)."""
    from engramrt.lookup import lookup_rows

    steps: dict[str, list[float]] = {}

    def mark(name: str, start: float) -> float:
        torch.cuda.synchronize()
        now = time.perf_counter()
        steps.setdefault(name, []).append(now - start)
        return now

    for _ in range(8):
        torch.cuda.synchronize()
        t = time.perf_counter()
        unique, inverse = torch.unique(row_ids, sorted=True, return_inverse=True)
        t = mark("torch.unique", t)
        ids = unique.cpu()
        t = mark("ids to host", t)
        bad = int(ids[0]) < 0 or int(ids[-1]) >= store.num_rows
        t = mark(f"range check ({bad})", t)
        rows = store._gather_to_device(ids)
        t = mark("gather + copy", t)
        lookup_rows(inverse, rows, backend="triton")
        t = mark("dequantise + scatter kernel", t)
    for name, values in steps.items():
        values = sorted(values[1:])
        print(f"  T={row_ids.shape[0]} {name:40s} {values[len(values) // 2] * 1e3:8.3f} ms")


def finish(args, report, records) -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    print("\n".join(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "environment": {
                        **environment(torch.device("cuda", torch.cuda.current_device())),
                        "cpus": len(os.sched_getaffinity(0)),
                    },
                    "table_gib": args.table_gib,
                    "results": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
