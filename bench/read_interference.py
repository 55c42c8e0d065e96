"""What slows the blocks when the GPU reads host rows beside them?

BENCHMARKS.md ("Step cost in every mode and loop", "Copy engines for the host reads"): a
decode step's read of 6,144 host rows takes several times longer beside the blocks than
alone, and costs the step about as much whatever the read kernel's grid. This study
separates the candidate causes on one GPU. It times ``--blocks``
decode blocks (the step bench's block at ``--tokens`` tokens: QKV, output, gated FFN)
alone, then with one of these started beside them on a side stream at the same moment:

- ``uva[R:W:P]``: the ``uva`` tier's read of ``--rows`` random rows of a ``--table-gib``
  pinned host table, with the lookup kernel's settings ``R`` rows a tile, ``W`` warps,
  at most ``P`` programs (``-``: one tile a program);
- ``device[R:W:P]``: the same kernel reading a device-memory table of the same size (the
  bus taken away, the kernel kept);
- ``spin[P:US]``: ``P`` programs of one warp that only watch the clock for ``US`` us
  (multiprocessors held, no memory traffic);

each on a side stream of priority 0 and of the highest priority (``--priorities``). Every
figure is the median of ``--reps`` CUDA-event timings (two warm-ups dropped, the device
synchronised between repetitions, so each repetition starts with both streams idle): the
blocks' time on their stream, and the side work's own time on its stream, alone and
beside. A slowdown that follows the spin as it does the reads says the multiprocessors
held are the cost; one that the device-table read does not show says the bus's latency
is.

    python bench/read_interference.py --out bench/results/read-interference-DATE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_overhead as ro
from engramrt.lookup.settings import LookupKernelConfig

ROW_BYTES, E = 264, 256
DEFAULT_SIDES = (
    "uva[default]", "uva[32:4:-]", "uva[8:1:-]", "uva[32:4:1]", "uva[32:4:132]",
    "device[default]", "spin[1:50]", "spin[16:50]", "spin[132:50]", "spin[132:10]",
)  # fmt: skip


def study_device(prog: str) -> torch.device | None:
    """The current CUDA device, or None after saying on stderr that ``prog`` needs one."""
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA device (none here)", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def table_rows(table_gib: float) -> int:
    """Rows of :data:`ROW_BYTES` in a table of ``table_gib`` GiB."""
    return int(table_gib * 2**30) // ROW_BYTES


def filled_store(tier: str, device: torch.device, num_rows: int) -> Any:
    """A store of tier ``tier`` holding ``num_rows`` packed rows (E = 256): one pattern of
    2**20 pseudo-random rows (seed 0) repeated, the same bytes for every tier."""
    from engramrt.lookup.tiers import TablePlacement, make_store

    store = make_store(TablePlacement(tier, device=device), num_rows=num_rows, E=E)
    rng = np.random.default_rng(0)
    fill = torch.from_numpy(rng.integers(0, 120, (1 << 20, ROW_BYTES), dtype=np.uint8))
    for start in range(0, num_rows, fill.shape[0]):
        count = min(fill.shape[0], num_rows - start)
        store.write_rows(start, fill[:count])
    return store


def parse_side(text: str) -> tuple[str, str]:
    """``KIND[ARGS]`` -> (kind, args), kind one of uva, device, spin."""
    kind, _, rest = text.partition("[")
    if kind not in ("uva", "device", "spin") or not rest.endswith("]"):
        raise ValueError(f"--sides: {text!r}; expected uva[R:W:P], device[R:W:P] or spin[P:US]")
    return kind, rest[:-1]


def kernel_config(args: str, default: LookupKernelConfig) -> LookupKernelConfig:
    """``R:W:P`` (``P`` may be ``-``) or ``default`` -> the lookup kernel's settings."""
    if args == "default":
        return default
    try:
        return ro.read_kernel_config(args)
    except ValueError as exc:
        raise ValueError(f"--sides: {exc}") from exc


def spin_args(args: str) -> tuple[int, float]:
    """``P:US`` -> (programs, microseconds)."""
    try:
        programs, us = args.split(":")
        out = int(programs), float(us)
    except ValueError as exc:
        raise ValueError(f"--sides: spin[{args}] ({exc}); expected spin[P:US]") from exc
    if out[0] < 1 or out[1] <= 0:
        raise ValueError(f"--sides: spin[{args}]; expected P >= 1 programs and US > 0")
    return out


def _spin_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, ns):
        # The clock read inline: a jit function takes no string held in a variable.
        pid = tl.program_id(0)
        start = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1
        )
        now = start
        while now - start < ns:
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1
            )
        tl.store(out_ptr + pid, now - start)

    return spin


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times[2:]), 4)


def timed_pair(
    blocks: Callable[[], None],
    side: Callable[[], None] | None,
    stream: torch.cuda.Stream,
    reps: int,
) -> dict[str, float]:
    """Median ms of ``blocks`` on the current stream and of ``side`` on ``stream``, both
    started at the same moment (``side`` None: the blocks alone; ``blocks`` may be a no-op
    for the side alone)."""
    main = torch.cuda.current_stream()
    main_ms, side_ms = [], []
    for _ in range(reps + 2):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        events[0].record(main)
        if side is not None:
            stream.wait_event(events[0])
            with torch.cuda.stream(stream):
                events[2].record(stream)
                side()
                events[3].record(stream)
        blocks()
        events[1].record(main)
        torch.cuda.synchronize()
        main_ms.append(events[0].elapsed_time(events[1]))
        if side is not None:
            side_ms.append(events[2].elapsed_time(events[3]))
    out = {"blocks_ms": _median_ms(main_ms)}
    if side is not None:
        out["side_ms"] = _median_ms(side_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6144, help="rows a read takes (decode 256)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens the blocks run")
    parser.add_argument("--blocks", type=int, default=2, help="decode blocks beside the read")
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES))
    parser.add_argument("--priorities", default="0,high", help="side-stream priorities")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        sides = [parse_side(s) for s in args.sides.split(",") if s]
        for kind, spec in sides:  # every spec checked before any table is filled
            if kind == "spin":
                spin_args(spec)
            elif spec != "default":
                kernel_config(spec, LookupKernelConfig())
        priorities = [p for p in args.priorities.split(",") if p]
        for p in priorities:
            if p != "high" and not p.lstrip("-").isdigit():
                raise ValueError(f"--priorities: {p!r}; expected integers or high")
    except ValueError as exc:
        parser.error(str(exc))
    device = study_device("read_interference")
    if device is None:
        return 2
    from engramrt.bench.runner import environment
    from engramrt.lookup.settings import check_kernel_config
    from engramrt.lookup.tiers.uva import UVA_KERNEL

    num_rows = table_rows(args.table_gib)
    rng = np.random.default_rng(0)
    row_ids = torch.from_numpy(rng.integers(0, num_rows, args.rows)).to(device).view(-1, 1)
    out = torch.empty((args.rows, 1, E), dtype=torch.bfloat16, device=device)
    stores: dict[str, Any] = {}

    def store_for(kind: str, spec: str) -> Any:
        """The ``kind`` tier's one store (filled once), its kernel set to ``spec``'s (a
        kernel store reads its ``kernel`` at every lookup)."""
        if kind not in stores:
            stores[kind] = filled_store(kind, device, num_rows)
        stores[kind].kernel = check_kernel_config(kernel_config(spec, UVA_KERNEL))
        return stores[kind]

    weights = ro.block_weights(args.blocks, device)
    x = torch.randn(args.tokens, ro.D, device=device, dtype=torch.bfloat16)

    def blocks() -> None:
        h = x
        for w in weights:
            h = ro.run_block(h, w)

    spin_out = torch.empty(1024, dtype=torch.int64, device=device)
    spin = None
    result: dict[str, Any] = {
        "environment": environment(device),
        "rows": args.rows,
        "row_bytes": ROW_BYTES,
        "table_gib": args.table_gib,
        "tokens": args.tokens,
        "blocks": args.blocks,
        "reps": args.reps,
        "default_uva_kernel": repr(UVA_KERNEL),
        "method": "CUDA events on each stream, both started at one moment, device synchronised "
        "between repetitions; median of reps after 2 warm-ups",
        "cases": [],
    }
    alone = timed_pair(blocks, None, torch.cuda.current_stream(), args.reps)
    result["blocks_alone_ms"] = alone["blocks_ms"]
    for priority in priorities:
        stream = torch.cuda.Stream(
            device, priority=ro.HIGHEST_PRIORITY if priority == "high" else int(priority)
        )
        for kind, spec in sides:
            case: dict[str, Any] = {"side": f"{kind}[{spec}]", "priority": priority}
            try:
                if kind == "spin":
                    programs, us = spin_args(spec)
                    if spin is None:
                        spin = _spin_kernel()
                    ns = int(us * 1000)

                    def side(programs=programs, ns=ns) -> None:
                        spin[(programs,)](spin_out, ns, num_warps=1)

                else:
                    store = store_for(kind, spec)

                    def side(store=store) -> None:
                        store.lookup(row_ids, out)

                case["side_alone_ms"] = timed_pair(lambda: None, side, stream, args.reps)["side_ms"]
                both = timed_pair(blocks, side, stream, args.reps)
                case["blocks_beside_ms"] = both["blocks_ms"]
                case["side_beside_ms"] = both["side_ms"]
                case["blocks_slowdown_us"] = round(
                    1e3 * (both["blocks_ms"] - alone["blocks_ms"]), 1
                )
                case["blocks_slowdown_pct"] = round(
                    100 * (both["blocks_ms"] / alone["blocks_ms"] - 1), 2
                )
            except Exception as exc:  # a kernel that does not build is a row, not the end
                case["error"] = f"{type(exc).__name__}: {exc}"
            result["cases"].append(case)
            print(json.dumps(case), flush=True)
    result["blocks_alone_ms_end"] = timed_pair(
        blocks, None, torch.cuda.current_stream(), args.reps
    )["blocks_ms"]
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ro.write_report(str(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
