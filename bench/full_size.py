"""The V4.1-Flash tables at full size in host memory: time to ready, restart, lookups.

    torchrun --nproc-per-node 2 bench/full_size.py [--layers 0,1] [--scale 1.0]
        [--hugepages none|thp] [--numa-placement none|interleave|bind|replicate] [--restart]
        [--out PATH]
    torchrun --nproc-per-node 2 bench/full_size.py --cpu --scale 0.0001 --restart   # gloo

Both layers' tables (384,006,168 and 384,016,682 rows of 264 B, 188.8 GiB;
``--scale`` multiplies the row counts) hold the rows of
:func:`~engramrt.lookup.tiers.synthetic.synthetic_packed_rows`, computed
from the row ids by :func:`~engramrt.distributed.fill.fill_synthetic_rows`
(on the rank's GPU, or numpy threads on ``--cpu``), published once per node
through :class:`~engramrt.distributed.SharedHostTable` in ``--shared-dir``
(default ``/dev/shm``) and mapped by every rank. Rank ``r`` takes layer
``r`` first, so two ranks fill two layers at once; then each maps the other.

Phases, each timed per rank and written to one JSON report (rank 0,
atomically):

1. preflight: the directory's size and free space against the tables not
   there yet; too small is a clear error before anything is written;
2. publish: ``allocate`` (sharing decision, clean-up, ``posix_fallocate``,
   mapping: everything before the loader runs), ``fill`` (the loader),
   ``publish`` (sample checksum, ``msync``/``fsync``, rename, manifest, the
   first read-only mapping); a rank that did not create a table records
   ``wait_attach`` instead (waiting for its creator included);
3. ``attach``: a fresh read-only mapping of every table after all are
   published (manifest, fingerprint and sample checksum checked), and
   ``register`` (``cudaHostRegister`` of each table, GPU runs only);
   ``ready_s``: from the start of phase 2 until every table is mapped and
   registered on every rank; peak resident memory per rank;
4. ``--restart``: each rank starts a fresh Python process that maps and
   registers the existing tables without rebuilding them (its loader would
   raise), checks a sample of rows bit for bit, and checks that a request
   with another fingerprint is refused; recorded: ``ready_s`` (map and
   register, after the process's CUDA context, which a serving process has
   before its tables), ``launch_to_ready_s`` (from the launch: imports and
   the CUDA context included) and ``process_s`` (with the checks and the
   exit, which unmaps and unregisters);
5. lookups per rank on its GPU: tiers ``host`` and ``uva`` (and the hot-row
   cache in front of ``uva``) at 256 and 8,192 tokens x 24 columns,
   uniform and Zipf ids, each checked bit for bit against the synthetic
   definition before it is timed (``triton.testing.do_bench`` median), on
   the full-size tables and on an ``--baseline-gib`` table (default 8 GiB)
   in the same run; on ``--cpu`` the host tier only, timed by wall clock;
6. the runtime bench's decode and prefill step on every GPU at once (data
   parallel, one shared table; the pieces of ``bench/runtime_overhead.py``)
   by its method: ``--rounds`` paired rounds, each timing every placement
   as a short block in an order shuffled per round, each placement's loss
   taken against no lookups (``none``) of the same round, with a second
   no-lookup runtime as the A/A control (``none-again``); placements
   ``host`` (the runtime's default: GPU reads for the first Engram layer,
   the CPU's gather for the second) and ``uva``.

``--expect-existing`` maps tables left by an earlier run (``--keep``)
instead of building them: a second invocation after a restart. The tables
are removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engramrt import memory
from engramrt._io import atomic_write_bytes
from engramrt.bench.runner import environment, median_seconds
from engramrt.config import PRESETS
from engramrt.distributed import SharedHostTable, default_directory, shared_store
from engramrt.distributed.fill import (
    FillStats,
    advise_hugepages,
    device_numa_node,
    hugepage_state,
    memory_policy,
    numa_nodes,
    synthetic_loader,
    synthetic_rows_numpy,
)
from engramrt.distributed.shared_table import TablePaths, free_bytes
from engramrt.errors import CapacityError, ValidationError
from engramrt.lookup.tiers import TablePlacement
from engramrt.lookup.tiers.synthetic import SyntheticOptions, SyntheticRowStore
from engramrt.packed import row_bytes_for

FLASH = PRESETS["dsv41-flash"]
E = FLASH.head_dim  # 256
ROW_BYTES = row_bytes_for(E)  # 264
COLS = 24
ZIPF_EXPONENT = 1.0  # as the cache benchmarks (engramrt.bench.cases_cache)
CACHE_FRACTION = 0.05
CACHE_WAYS = 8


@dataclass(frozen=True)
class TableSpec:
    """One table of the run: its file name, rows and what they are."""

    name: str
    layer_index: int
    layer_id: int
    num_rows: int
    seed: int
    fingerprint: str

    @property
    def nbytes(self) -> int:
        return self.num_rows * ROW_BYTES


def fingerprint_of(what: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def table_specs(layers: list[int], scale: float, seed: int, suffix: str = "") -> list[TableSpec]:
    """The run's tables: V4.1-Flash layer ``i``'s row count times ``scale`` (at least 1)."""
    specs = []
    for index in layers:
        num_rows = max(1, round(FLASH.num_embeddings[index] * scale))
        layer_id = FLASH.layer_ids[index]
        described = {
            "rows": "engramrt.lookup.tiers.synthetic.synthetic_packed_rows",
            "seed": seed,
            "layer_id": layer_id,
            "num_rows": num_rows,
            "E": E,
        }
        specs.append(
            TableSpec(
                f"engramrt-fullsize-layer{layer_id}{suffix}",
                index,
                layer_id,
                num_rows,
                seed,
                fingerprint_of(described),
            )
        )
    return specs


def baseline_spec(gib: float, seed: int, suffix: str = "") -> TableSpec:
    """The small table of the same rows that earlier host-tier numbers were measured on
    (``gib`` GiB whatever ``--scale``)."""
    num_rows = max(1, round(gib * 2**30) // ROW_BYTES)
    described = {"rows": "synthetic_packed_rows", "seed": seed, "num_rows": num_rows, "E": E}
    return TableSpec(
        f"engramrt-fullsize-baseline{suffix}", -1, -1, num_rows, seed, fingerprint_of(described)
    )


# --- what the machine looks like ------------------------------------------------------


def memory_report() -> dict[str, int]:
    """Peak and current resident memory of this process, bytes."""
    report = {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                report[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return report


def directory_report(directory: Path) -> dict[str, Any]:
    stats = os.statvfs(directory)
    return {
        "path": str(directory),
        "size_bytes": stats.f_blocks * stats.f_frsize,
        "free_bytes": free_bytes(directory),
    }


def preflight(directory: Path, specs: list[TableSpec]) -> dict[str, Any]:
    """The directory must hold the tables not yet there; raises :class:`CapacityError` if not."""
    if not directory.is_dir():
        raise CapacityError(
            f"--shared-dir {directory} does not exist; expected a directory on a memory file "
            f"system (/dev/shm, or a tmpfs mounted for the tables)"
        )
    report = directory_report(directory)
    missing = [s for s in specs if not TablePaths(directory, s.name).manifest.exists()]
    needed = sum(s.nbytes for s in missing)
    report["needed_bytes"] = needed
    if needed > report["free_bytes"]:
        raise CapacityError(
            f"--shared-dir {directory}: the tables {[s.name for s in missing]} need "
            f"{memory.format_bytes(needed)} but it has {memory.format_bytes(report['free_bytes'])} "
            f"free of {memory.format_bytes(report['size_bytes'])}; expected room for them: "
            f"enlarge it (docker run --shm-size={-(-needed // 2**30) + 1}g, or mount -o "
            f"remount,size=... {directory}), pass --shared-dir on a larger memory file system, "
            f"or fewer rows (--layers, --scale)"
        )
    return report


def host_environment(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The runner's :func:`environment` and this host's: its name, CPUs, NUMA nodes and huge
    pages, with the command that ran."""
    return {
        **environment(device),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "numa_nodes": numa_nodes(),
        "hugepages": hugepage_state(args.shared_dir),
        "command": " ".join(sys.argv),
        "args": vars(args),
    }


# --- building and mapping the tables ---------------------------------------------------


def missing_loader(spec: TableSpec) -> Callable[[torch.Tensor], None]:
    def load(target: torch.Tensor) -> None:
        raise RuntimeError(
            f"table {spec.name!r} is not in the directory; expected one published by an "
            f"earlier run (--expect-existing maps, never builds)"
        )

    return load


def publish_tables(
    specs: list[TableSpec], args: argparse.Namespace, device: torch.device, placement: list[int]
) -> tuple[list[SharedHostTable], list[dict[str, Any]]]:
    """Every rank maps every table; rank ``r`` takes ``specs[r]`` first (its creator, if free)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tables: dict[str, SharedHostTable] = {}
    phases = []
    fillers = min(world, len(specs))
    threads = args.fill_threads or max(1, len(os.sched_getaffinity(0)) // fillers)
    fill_device = device if args.fill_device == "auto" else torch.device(args.fill_device)
    policy = args.numa_placement if args.numa_placement != "replicate" else "bind"
    for round_index in range(len(specs)):
        spec = specs[(rank + round_index) % len(specs)]
        stats: list[FillStats] = []
        marks: dict[str, float] = {}
        fill = synthetic_loader(
            E,
            spec.seed,
            num_threads=threads,
            device=fill_device,
            hugepages=args.hugepages == "thp",
            numa=(policy, placement),
            stats=stats,
            copy=args.fill_copy if fill_device.type == "cuda" else "staged",
        )

        def load(target: torch.Tensor, fill=fill, marks=marks) -> None:
            marks["fill_start"] = time.perf_counter()
            fill(target)
            marks["fill_end"] = time.perf_counter()

        loader = missing_loader(spec) if args.expect_existing else load
        start = time.perf_counter()
        with memory_policy(policy, placement) as numa:
            table = SharedHostTable.create_or_attach(
                spec.name,
                spec.num_rows,
                ROW_BYTES,
                loader,
                directory=args.shared_dir,
                group=dist.group.WORLD,
                fingerprint=spec.fingerprint,
                replace_mismatched=not args.expect_existing,
                private_fallback=False,
                reserve=args.reserve,
            )
        end = time.perf_counter()
        phase: dict[str, Any] = {"table": spec.name, "created": table.created, "numa": numa}
        if table.created:
            phase.update(
                allocate_s=marks["fill_start"] - start,
                fill_s=marks["fill_end"] - marks["fill_start"],
                publish_s=end - marks["fill_end"],
                fill=asdict(stats[0]) | {"bytes_per_s": stats[0].bytes_per_s},
            )
        else:
            phase["wait_attach_s"] = end - start
        if args.hugepages == "thp":
            phase["madvise_mapping"] = advise_hugepages(table.rows)
        phases.append(phase)
        tables[spec.name] = table
    return [tables[spec.name] for spec in specs], phases


def attach_and_register(
    specs: list[TableSpec], tables: list[SharedHostTable], args: argparse.Namespace
) -> dict[str, Any]:
    """A fresh mapping of each table (checks included), then each table registered for CUDA."""
    attach = {}
    for spec in specs:
        start = time.perf_counter()
        mapped = SharedHostTable.attach(
            spec.name, spec.num_rows, ROW_BYTES, directory=args.shared_dir,
            fingerprint=spec.fingerprint,
        )  # fmt: skip
        attach[spec.name] = time.perf_counter() - start
        del mapped
    register = {}
    if torch.cuda.is_available() and not args.cpu:
        for table in tables:
            start = time.perf_counter()
            table.register_cuda()
            register[table.name] = time.perf_counter() - start
    return {"attach_s": attach, "register_s": register}


def check_sample(spec: TableSpec, rows: torch.Tensor, count: int = 64, seed: int = 0) -> bool:
    """``count`` random rows of a mapped table equal the synthetic rows, bit for bit."""
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, spec.num_rows, count))
    ids = np.concatenate([[0], ids, [spec.num_rows - 1]])
    found = rows.numpy()[ids]
    expected = np.stack([synthetic_rows_numpy(int(i), 1, E, spec.seed)[0] for i in ids])
    return bool(np.array_equal(found, expected))


def probe(args: argparse.Namespace) -> None:
    """A fresh process after a restart: map (and register) the existing tables, check them."""
    device = torch.device(args.probe_device)
    cuda_init = time.perf_counter()
    if device.type == "cuda":  # a serving process has its CUDA context before its tables
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    start = time.perf_counter()
    specs = json.loads(args.probe_specs)
    tables = []
    for item in specs:
        spec = TableSpec(**item)
        begin = time.perf_counter()
        table = SharedHostTable.attach(
            spec.name, spec.num_rows, ROW_BYTES, directory=args.shared_dir,
            fingerprint=spec.fingerprint,
        )  # fmt: skip
        mapped = time.perf_counter()
        if device.type == "cuda":
            table.register_cuda()
        tables.append((spec, table, mapped - begin, time.perf_counter() - mapped))
    ready = time.perf_counter() - start
    launch_to_ready = time.time() - args.probe_launched
    results = []
    for spec, table, attach_s, register_s in tables:  # the checks, after ready
        try:
            SharedHostTable.attach(
                spec.name, spec.num_rows, ROW_BYTES, directory=args.shared_dir,
                fingerprint=spec.fingerprint + "-other",
            )  # fmt: skip
            refused = False
        except ValidationError:
            refused = True
        results.append(
            {
                "table": spec.name,
                "attach_s": attach_s,
                "register_s": register_s,
                "manifest_fingerprint_ok": table.manifest is not None
                and table.manifest["fingerprint"] == spec.fingerprint,
                "sample_rows_exact": check_sample(spec, table.rows),
                "other_fingerprint_refused": refused,
                "created": table.created,
            }
        )
    print(
        json.dumps(
            {
                "tables": results,
                "ready_s": ready,
                "launch_to_ready_s": launch_to_ready,
                "cuda_init_s": start - cuda_init,
                "memory": memory_report(),
            }
        )
    )


def restart(
    specs: list[TableSpec], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Start a fresh process that maps the existing tables; its time to ready and checks."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--probe",
        "--shared-dir",
        str(args.shared_dir),
        "--probe-device",
        str(device) if device.type == "cuda" else "cpu",
        "--probe-specs",
        json.dumps([asdict(s) for s in specs]),
        "--probe-launched",
    ]
    start = time.perf_counter()
    command.append(repr(time.time()))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"ok": False, "process_s": wall, "error": done.stderr[-2000:]}
    report = json.loads(done.stdout.strip().splitlines()[-1])
    checks = [
        t["manifest_fingerprint_ok"]
        and t["sample_rows_exact"]
        and t["other_fingerprint_refused"]
        and not t["created"]
        for t in report["tables"]
    ]
    return {"ok": all(checks), "process_s": wall, **report}


# --- lookups ---------------------------------------------------------------------------


def row_ids(num_rows: int, num_tokens: int, dist_name: str, seed: int) -> torch.Tensor:
    """``[num_tokens, COLS]`` int64 ids: uniform, or Zipf ranks scattered over the rows."""
    g = torch.Generator().manual_seed(seed)
    if dist_name == "uniform":
        return torch.randint(0, num_rows, (num_tokens, COLS), generator=g)
    # Zipf ranks by inverse transform of the continuous approximation of
    # P(rank r) ~ 1/r (exponent 1): rank = num_rows ** u, then scattered
    # over the table by a multiplier coprime with num_rows.
    u = torch.rand((num_tokens, COLS), generator=g, dtype=torch.float64)
    ranks = (torch.pow(float(num_rows), u) - 1).long().clamp_(0, num_rows - 1)
    multiplier = 2_654_435_761
    while np.gcd(multiplier, num_rows) != 1:
        multiplier += 2
    return (ranks * multiplier + 12_345) % num_rows


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        # warmup and rep are milliseconds of calls; the median is reported.
        return float(triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median"))
    return 1e3 * median_seconds(fn, reps, warmup=2)


def lookup_cases(
    spec: TableSpec,
    table: SharedHostTable,
    args: argparse.Namespace,
    device: torch.device,
    label: str,
) -> list[dict[str, Any]]:
    """host and uva tiers (and the cache over uva) on one table, checked, then timed."""
    reference = SyntheticRowStore(spec.num_rows, E, SyntheticOptions(seed=spec.seed), device=device)
    stores: dict[str, Any] = {"host": shared_store(table, TablePlacement("host", device))}
    if device.type == "cuda":
        stores["uva"] = shared_store(table, TablePlacement("uva", device))
    results = []
    rank = dist.get_rank()
    for dist_name in ("uniform", "zipf"):
        if device.type == "cuda" and not args.skip_cache:
            from engramrt.cache import CachedRowStore

            capacity = max(CACHE_WAYS, int(CACHE_FRACTION * spec.num_rows)) * ROW_BYTES
            cache = CachedRowStore(stores["uva"], capacity, CACHE_WAYS, layer_id=spec.layer_id)
            cache.warm_up(
                row_ids(spec.num_rows, 8192, dist_name, seed=10_000 + step).to(device)
                for step in range(8)
            )
            stores[f"cached(uva, {CACHE_FRACTION:.0%})"] = cache
        for num_tokens in args.tokens:
            ids = row_ids(spec.num_rows, num_tokens, dist_name, seed=1000 * rank + num_tokens)
            ids = ids.to(device)
            expected = reference.lookup(ids)
            for tier, store in stores.items():
                exact = torch.equal(store.lookup(ids).view(torch.int16), expected.view(torch.int16))
                ms = (
                    time_ms(lambda s=store, i=ids: s.lookup(i), device, args.reps)
                    if exact
                    else None
                )
                rows = num_tokens * COLS
                results.append(
                    {
                        "table": label,
                        "rows_in_table": spec.num_rows,
                        "tier": tier,
                        "ids": dist_name,
                        "T": num_tokens,
                        "exact": exact,
                        "ms": ms,
                        "rows_per_s": rows / (ms / 1e3) if ms else None,
                    }
                )
        stores.pop(f"cached(uva, {CACHE_FRACTION:.0%})", None)
    return results


def paired_rounds(
    blocks: dict[tuple[str, str, bool], Callable[[int], float]],
    rounds: int,
    seed: int,
    reference: str = "none",
    control: str = "none-again",
) -> list[dict[str, Any]]:
    """Time every block once a round, in an order shuffled per round, and compare each
    with the reference placement's block of the same round (the runtime bench's method,
    BENCHMARKS.md#step-cost-with-host-memory-tables: the GPU's clock drifts by more
    than the costs measured, so only blocks timed moments apart are compared).

    ``blocks`` maps ``(placement, workload, prefetch)`` to a callable that runs round
    ``r``'s block and returns its ms/step. ``reference`` and ``control`` (the A/A
    control: a second instance of the reference) must have a block for every
    ``(workload, prefetch)``. Every rank must pass the same keys and seed: the order is
    drawn from ``seed`` alone, so ranks time the same block at once.
    """
    keys = list(blocks)
    for _, workload, prefetch in keys:
        for needed in (reference, control):
            if (needed, workload, prefetch) not in blocks:
                raise ValueError(f"no {needed!r} block for {workload!r}, prefetch={prefetch}")
    rng = np.random.default_rng(seed)
    ms: dict[tuple[str, str, bool], list[float]] = {key: [] for key in keys}
    for round_index in range(rounds):
        for i in rng.permutation(len(keys)):
            ms[keys[i]].append(blocks[keys[i]](round_index))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_overhead as ro

    results = []
    for key in keys:
        placement, workload, prefetch = key
        p25, p50, p75 = ro.quartiles(ms[key])
        results.append(
            {
                "placement": placement,
                "workload": workload,
                "prefetch": prefetch,
                "rounds": rounds,
                "ms_per_step": p50,
                "ms_per_step_p25": p25,
                "ms_per_step_p75": p75,
                "ms_per_step_rounds": ms[key],
                **ro.paired_stats("loss_pct", ms[key], ms[(reference, workload, prefetch)]),
            }
        )
    return results


RUNTIME_PLACEMENTS = ("host", "host-per-layer", "host-shared", "host-ids", "uva")
"""Placements the runtime phase can time (``--runtime-placements``): ``host`` with the
runtime's defaults, ``host-per-layer`` / ``host-shared`` with that ``lookup_workers``,
``host-ids`` with ids hashed on the host, ``uva``."""


def runtime_steps(
    tables: list[SharedHostTable], args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """The runtime bench's decode and prefill steps on this rank's GPU over the shared
    tables, by paired rounds (:func:`paired_rounds`): ``--runtime-placements``, by
    default the default placement (``host``: the GPU reads the first Engram layer's
    rows, the CPU gathers the second's) and ``uva``, and on request ``host-ids`` (host
    tables, every layer's ids hashed on the host: ``plan(batch.with_host(host))``), against
    no lookups at all (``none``, the fixed rows an Engram layer would read), with a
    second no-lookup runtime as the A/A control (``none-again``); ``--sync-steps`` makes
    the host wait for each step before planning the next."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_overhead as ro
    from engramrt.hashing import HashConstants, NgramHasher
    from engramrt.layout import EngramLayout
    from engramrt.runtime import EngramRuntime
    from engramrt.tokenmap import TokenMap

    smallest = min(t.num_rows for t in tables)
    config = ro.scaled_config(smallest * ROW_BYTES / 2**30 * 0.999)
    layout = EngramLayout(config)
    if max(layout.num_embeddings) > smallest:
        raise ValidationError(
            f"runtime layout needs {max(layout.num_embeddings)} rows; the tables have {smallest}"
        )
    layer_tables = [tables[0], tables[-1]]  # one table serves both layers when one is given
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(config))
    rng = np.random.default_rng(dist.get_rank())
    workloads = {
        "decode 256x1": ro.decode_batches(rng, token_map.vocab_size, args.decode_steps, device),
        "prefill 512 seqs 100-1024": ro.prefill_batches(rng, token_map.vocab_size, device),
    }
    backbone = ro.make_backbone(config, device)
    runtimes: dict[str, Any] = {}
    for placement in ("none", "none-again", *args.runtime_placements.split(",")):
        if placement.startswith("none"):
            runtimes[placement] = ro.NoLookups(8192, config.n_cols, config.head_dim, device)
            continue
        if placement not in RUNTIME_PLACEMENTS:
            raise ValidationError(
                f"--runtime-placements: {placement!r}; expected some of "
                f"{', '.join(RUNTIME_PLACEMENTS)}"
            )
        tier = "uva" if placement == "uva" else "host"
        stores = [shared_store(t, TablePlacement(tier, device)) for t in layer_tables]
        hasher = NgramHasher(consts, token_map, device, validate=False)
        workers = {"host-per-layer": "per-layer", "host-shared": "shared"}
        runtime = EngramRuntime(
            hasher,
            stores,
            max_tokens=8192,
            max_requests=512,
            validate=False,
            **({"lookup_workers": workers[placement]} if placement in workers else {}),
        )
        runtimes[placement] = ro.HostIdsRuntime(runtime) if placement == "host-ids" else runtime
    blocks: dict[tuple[str, str, bool], Callable[[int], float]] = {}
    stalls: dict[tuple[str, str, bool], list[list[float]]] = defaultdict(list)
    for placement, runtime in runtimes.items():
        for name, batches in workloads.items():
            decode = name.startswith("decode")
            forward = ro.eager_forward(backbone, device)
            if decode:
                forward = ro.GraphedBackbone(runtime, backbone, batches[0].num_tokens, device).step
            steps = args.block_steps if decode else args.prefill_chunks
            for prefetch in (False, True):

                def block(
                    round_index: int,
                    placement=placement,
                    name=name,
                    decode=decode,
                    runtime=runtime,
                    batches=batches,
                    forward=forward,
                    prefetch=prefetch,
                    steps=steps,
                ) -> float:
                    warm, timed = ro.block_window(len(batches), round_index, steps, warmup=2)
                    sync = args.sync_steps
                    ro.run(runtime, [batches[i] for i in warm], forward, prefetch, None, sync)
                    dist.barrier()  # every GPU steps at once
                    timed_batches = [batches[i] for i in timed]
                    events = ro.StallEvents(steps) if decode and placement != "none" else None
                    res = ro.run(runtime, timed_batches, forward, prefetch, events, sync)
                    if events is not None:  # the median wait per layer, this round
                        waits = events.stall_us(steps)
                        stalls[(placement, name, prefetch)].append(
                            [float(np.median(layer)) for layer in waits]
                        )
                    return res["ms_per_step"]

                blocks[(placement, name, prefetch)] = block
    results = paired_rounds(blocks, args.rounds, args.seed)
    for row in results:  # each round's median wait per layer (decode; CUDA events)
        key = (row["placement"], row["workload"], row["prefetch"])
        if stalls.get(key):
            row["stall_us_rounds"] = stalls[key]
    for runtime in runtimes.values():
        runtime.close()
    return results


# --- the run -----------------------------------------------------------------------------


def check_only(args: argparse.Namespace) -> None:
    """What the machine offers for the run, and whether the tables fit; no tables built."""
    directory = Path(args.shared_dir or default_directory())
    specs = table_specs(args.layers, args.scale, args.seed)
    if args.baseline_gib > 0:
        specs.append(baseline_spec(args.baseline_gib, args.seed))
    print(
        json.dumps({"numa_nodes": numa_nodes(), "hugepages": hugepage_state(directory)}, indent=1)
    )
    try:
        report = preflight(directory, specs)
    except CapacityError as exc:
        raise SystemExit(f"preflight: {exc}") from exc
    print(
        f"{directory}: {memory.format_bytes(report['size_bytes'])} in all, "
        f"{memory.format_bytes(report['free_bytes'])} free, the tables need "
        f"{memory.format_bytes(report['needed_bytes'])}: fits"
    )


def placement_nodes(args: argparse.Namespace, device: torch.device) -> list[int]:
    """NUMA nodes the tables' pages go to (``--numa``)."""
    if args.numa_placement == "interleave":
        return numa_nodes()
    node = device_numa_node(device)
    return [node if node is not None else numa_nodes()[0]]


def main() -> None:
    args = parse_args()
    if args.probe:
        probe(args)
        return
    if args.preflight_only:
        check_only(args)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu or not torch.cuda.is_available():
        args.cpu = True
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    args.shared_dir = Path(args.shared_dir or default_directory())
    args.shared_dir.mkdir(parents=True, exist_ok=True)
    placement = placement_nodes(args, device)
    suffix = f"-numa{placement[0]}" if args.numa_placement == "replicate" else ""
    specs = table_specs(args.layers, args.scale, args.seed, suffix)
    extra = [baseline_spec(args.baseline_gib, args.seed, suffix)]
    extra = extra if args.baseline_gib > 0 else []
    report: dict[str, Any] = {"rank": rank, "device": str(device), "placement_nodes": placement}
    report["memory_before"] = memory_report()
    failures: list[str] = []
    try:
        # Every rank's tables (--numa-placement replicate: one set per NUMA node), each name once.
        everyones: list[Any] = [None] * world
        dist.all_gather_object(everyones, [asdict(spec) for spec in specs + extra])
        union = {item["name"]: TableSpec(**item) for mine in everyones for item in mine}
        report["preflight"] = preflight(args.shared_dir, list(union.values()))
        dist.barrier()
        start = time.perf_counter()
        tables, report["publish"] = publish_tables(specs, args, device, placement)
        dist.barrier()
        report.update(attach_and_register(specs, tables, args))
        dist.barrier()
        report["ready_s"] = time.perf_counter() - start
        report["memory_ready"] = memory_report()
        report["hugepages_ready"] = hugepage_state(args.shared_dir)["meminfo_bytes"]
        report["sample_rows_exact"] = all(check_sample(s, t.rows) for s, t in zip(specs, tables))
        if not report["sample_rows_exact"]:
            failures.append(f"rank {rank}: sampled rows differ from the synthetic rows")
        if args.restart:
            report["restart"] = restart(specs, args, device)
            if not report["restart"]["ok"]:
                failures.append(f"rank {rank}: restart: {report['restart']}")
        baseline: list[SharedHostTable] = []
        if extra:
            baseline, report["publish_baseline"] = publish_tables(extra, args, device, placement)
        report["lookups"] = []
        if not args.skip_lookups:
            for spec, table in zip(specs + extra, tables + baseline):
                label = "baseline" if spec in extra else f"layer{spec.layer_id}"
                report["lookups"] += lookup_cases(spec, table, args, device, label)
            failures += [
                f"rank {rank}: lookup {r['table']} {r['tier']} {r['ids']} T={r['T']} not exact"
                for r in report["lookups"]
                if not r["exact"]
            ]
        if device.type == "cuda" and not args.skip_runtime:
            report["runtime"] = runtime_steps(tables, args, device)
        report["memory_end"] = memory_report()
        del tables, baseline
    except Exception as exc:  # every rank reports; rank 0 writes what it has
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        report["error"] = failures[-1]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"report": report, "failures": failures})
    if rank == 0:
        if not args.keep:
            for spec in specs + extra:
                SharedHostTable.remove(spec.name, args.shared_dir)
        everything = {
            "environment": host_environment(args, device),
            "world": world,
            "tables": [asdict(s) | {"nbytes": s.nbytes} for s in specs + extra],
            "ranks": [item["report"] for item in gathered],
            "failures": [f for item in gathered for f in item["failures"]],
        }
        if not args.out and not args.cpu:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            args.out = str(Path(__file__).resolve().parent / "results" / f"full-size-{stamp}.json")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(args.out, json.dumps(everything, indent=1, default=str).encode())
        print_summary(everything)
    dist.barrier()
    dist.destroy_process_group()
    if any(item["failures"] for item in gathered):
        raise SystemExit(f"rank {rank}: {[f for item in gathered for f in item['failures']]}")


def print_summary(everything: dict[str, Any]) -> None:
    for item in everything["ranks"]:
        rank = item["rank"]
        for phase in item.get("publish", []):
            times = ", ".join(
                f"{key[:-2]} {phase[key]:.2f} s"
                for key in ("allocate_s", "fill_s", "publish_s", "wait_attach_s")
                if key in phase
            )
            print(f"rank {rank} {phase['table']:36s} {times} (numa: {phase['numa']})")
        attach = sum(item.get("attach_s", {}).values())
        register = sum(item.get("register_s", {}).values())
        peak = item.get("memory_ready", {}).get("VmHWM", 0) / 2**30
        print(
            f"rank {rank} ready {item.get('ready_s', float('nan')):.2f} s (attach {attach:.2f} s, "
            f"register {register:.2f} s), peak RSS {peak:.2f} GiB"
        )
        if "restart" in item:
            r = item["restart"]
            print(
                f"rank {rank} restart: {'ok' if r['ok'] else 'FAILED'}, ready "
                f"{r.get('launch_to_ready_s', float('nan')):.2f} s after launch (imports and "
                f"CUDA context included), {r.get('ready_s', float('nan')):.2f} s in the process "
                f"(map and register), process with checks and exit {r['process_s']:.2f} s"
            )
        for r in item.get("lookups", []):
            ms = f"{r['ms']:9.3f} ms" if r["ms"] is not None else "  MISMATCH  "
            print(f"rank {rank} {r['table']:9s} {r['tier']:15s} {r['ids']:7s} T={r['T']:5d} {ms}")
        for r in item.get("runtime", []):
            print(
                f"rank {rank} runtime {r['placement']:10s} {r['workload']:26s} prefetch="
                f"{r['prefetch']!s:5s} {r['ms_per_step']:8.3f} ms/step, loss {r['loss_pct']:6.2f}% "
                f"[{r['loss_pct_p25']:.2f}, {r['loss_pct_p75']:.2f}] over {r['rounds']} rounds"
                + _stall_text(r.get("stall_us_rounds"))
            )
    for failure in everything["failures"]:
        print(f"FAILED: {failure}")


def _stall_text(rounds: list[list[float]] | None) -> str:
    """``, stall us L0/L1 a/b`` (the median over rounds of each round's median wait), or ""."""
    if not rounds:
        return ""
    per_layer = [float(np.median([r[li] for r in rounds])) for li in range(len(rounds[0]))]
    return ", stall us " + "/".join(f"{v:.0f}" for v in per_layer)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,1", help="V4.1-Flash layer indices (0,1)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each table's rows")
    parser.add_argument("--seed", type=int, default=0, help="which synthetic table")
    parser.add_argument("--hugepages", choices=("none", "thp"), default="none")
    parser.add_argument(
        "--numa-placement",  # not --numa: torchrun would take it for its --numa-binding
        choices=("none", "interleave", "bind", "replicate"),
        default="none",
        help="interleave: pages over every node; bind: each table on the node of its creator's "
        "GPU; replicate: one copy of every table per node, each rank mapping its GPU's node's",
    )
    parser.add_argument(
        "--reserve",
        choices=("fallocate", "truncate"),
        default="fallocate",
        help="how the creator reserves a table (SharedHostTable reserve=): fallocate "
        "allocates in one thread, truncate leaves it to the fill's threads",
    )
    parser.add_argument("--restart", action="store_true", help="time a fresh process mapping")
    parser.add_argument(
        "--preflight-only",
        action="store_true",
        help="no torchrun needed: print the directory's size, NUMA and huge page state, exit 1 "
        "when the tables do not fit",
    )
    parser.add_argument("--expect-existing", action="store_true", help="map, never build")
    parser.add_argument("--keep", action="store_true", help="leave the tables for a restart")
    parser.add_argument(
        "--shared-dir", default=None, help="default: $ENGRAMRT_SHARED_DIR, /dev/shm"
    )
    parser.add_argument("--fill-device", default="auto", help="auto (the rank's device), cpu")
    parser.add_argument("--fill-threads", type=int, default=0, help="0: CPUs / fillers")
    parser.add_argument(
        "--fill-copy",
        choices=("staged", "direct"),
        default="staged",
        help="a GPU fill's copies (fill_synthetic_rows copy=): staged through pinned buffers "
        "and CPU threads, or direct into the table registered for CUDA",
    )
    parser.add_argument("--baseline-gib", type=float, default=8.0, help="0: no baseline table")
    parser.add_argument("--tokens", default="256,8192")
    parser.add_argument("--reps", type=int, default=200, help="GPU: ms of timed calls; CPU: calls")
    parser.add_argument("--decode-steps", type=int, default=100, help="decode batches drawn")
    parser.add_argument("--rounds", type=int, default=12, help="paired rounds of the runtime phase")
    parser.add_argument("--block-steps", type=int, default=20, help="timed decode steps a block")
    parser.add_argument(
        "--prefill-chunks", type=int, default=4, help="timed prefill chunks a block"
    )
    parser.add_argument(
        "--runtime-placements",
        default="host,uva",
        help=f"runtime phase: placements timed against no lookups, some of "
        f"{', '.join(RUNTIME_PLACEMENTS)} (host-ids: host tables, ids hashed on the host)",
    )
    parser.add_argument(
        "--sync-steps",
        action="store_true",
        help="runtime phase: the host waits for each step before planning the next",
    )
    parser.add_argument("--skip-lookups", action="store_true")
    parser.add_argument("--skip-cache", action="store_true")
    parser.add_argument("--skip-runtime", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="gloo, no CUDA (a smoke run)")
    parser.add_argument(
        "--out", default=None, help="default: bench/results/full-size-<UTC time>.json (GPU runs)"
    )
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--probe-specs", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--probe-launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.probe:
        args.layers = [int(x) for x in args.layers.split(",")]
        if not args.layers or any(i not in (0, 1) for i in args.layers):
            parser.error(f"--layers {args.layers}; expected indices among 0,1")
        if not 0 < args.scale <= 1:
            parser.error(f"--scale {args.scale}; expected 0 < scale <= 1")
        args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


if __name__ == "__main__":
    main()
