"""How much host memory a host-memory table really takes (needs CUDA).

    python bench/host_alloc_size.py [--gib 3.03] [--out PATH]

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every
request up to a power of two: a 94 GiB table would take 128 GiB. The
``host`` and ``uva`` tiers instead allocate exactly the table's bytes
(``torch.empty`` on the heap, an anonymous ``mmap`` at these sizes) and
page-lock them in place with ``cudaHostRegister``. This script measures it,
per placement, from the kernel's own accounting of the process
(``/proc/self/status``: ``VmSize``, the address space reserved, and
``VmLck``/``VmPin``, what is locked), before and after building the store
for a table whose size is *not* a power of two (default 3.03 GiB, 12.3 M rows
of 264 B: the next power of two is 4 GiB), then after one lookup (which
allocates the tier's staging buffers). The control is
``torch.empty(nbytes, pin_memory=True)`` of the same size, measured the same
way: it shows what rounding looks like, so a reading of "exact" is not an
artefact of the method.

Writes one JSON object (``--out``, default
``bench/results/host-alloc-size-<date>.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROW_BYTES = 264
E = 256
KIB = 1024


def _status_kib() -> dict[str, int]:
    """The ``Vm*`` lines of ``/proc/self/status`` in KiB."""
    fields: dict[str, int] = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name.startswith("Vm") and rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0])
    return fields


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Growth in bytes of the address space, the resident set and locked memory."""
    return {
        key: (after.get(key, 0) - before.get(key, 0)) * KIB
        for key in ("VmSize", "VmRSS", "VmLck", "VmPin")
    }


def _measure_store(tier: str, num_rows: int) -> dict[str, Any]:
    from engramrt.lookup.tiers import TablePlacement, make_store

    gc.collect()
    before = _status_kib()
    store = make_store(TablePlacement(tier, "cuda"), num_rows=num_rows, E=E)
    torch.cuda.synchronize()
    built = _status_kib()
    ids = torch.randint(0, num_rows, (256, 24), device="cuda")
    store.fetch(ids)
    torch.cuda.synchronize()
    looked_up = _status_kib()
    table_bytes = num_rows * ROW_BYTES
    result = {
        "placement": f"tier={tier}",
        "table_bytes": table_bytes,
        "after_build": _delta(before, built),
        "after_lookup": _delta(built, looked_up),
    }
    result["address_space_over_table"] = result["after_build"]["VmSize"] - table_bytes
    del store
    gc.collect()
    return result


def _measure_pinned_control(nbytes: int) -> dict[str, Any]:
    gc.collect()
    before = _status_kib()
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    after = _status_kib()
    result = {
        "placement": "torch.empty(pin_memory=True) (control)",
        "table_bytes": nbytes,
        "after_build": _delta(before, after),
        "after_lookup": {},
    }
    result["address_space_over_table"] = result["after_build"]["VmSize"] - nbytes
    del block
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # return the block to the OS between runs
        torch._C._host_emptyCache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.03, help="table size in GiB")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_alloc_size: needs a CUDA device (cudaHostRegister)", file=sys.stderr)
        return 2
    num_rows = int(args.gib * 2**30) // ROW_BYTES
    nbytes = num_rows * ROW_BYTES
    torch.cuda.init()
    rows = [_measure_store("host", num_rows), _measure_store("uva", num_rows)]
    rows.append(_measure_pinned_control(nbytes))
    from engramrt.bench.runner import environment

    record = {
        "environment": environment(torch.device("cuda", torch.cuda.current_device())),
        "num_rows": num_rows,
        "row_bytes": ROW_BYTES,
        "next_power_of_two": 1 << (nbytes - 1).bit_length(),
        "method": "/proc/self/status VmSize/VmRSS/VmLck/VmPin deltas around building the store "
        "and around one 256 x 24 lookup",
        "results": rows,
    }
    print(f"table {nbytes / 2**30:.3f} GiB ({num_rows} rows of {ROW_BYTES} B)")
    for row in rows:
        build = row["after_build"]
        print(
            f"{row['placement']:42s} address space +{build['VmSize'] / 2**30:.3f} GiB "
            f"(over the table: {row['address_space_over_table'] / 2**20:+.1f} MiB), "
            f"resident +{build['VmRSS'] / 2**30:.3f} GiB; after a lookup: "
            + ", ".join(f"{k} {v / 2**20:+.1f} MiB" for k, v in row["after_lookup"].items())
        )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path("bench/results") / f"host-alloc-size-{stamp}.json"
    from engramrt._io import atomic_write_bytes

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, json.dumps(record, indent=2).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
