"""Benchmark cases of the hot-row cache in front of the host tier (GPU).

``T`` tokens x ``C = 24`` hash columns of ``E = 256`` values; the host tier
holds a table of 8 GiB (1 GiB for ``quick``) of random packed rows. Row ids
are skewed: rank ``r`` (1-based) of the table's rows is drawn with
probability proportional to ``r ** -ZIPF_EXPONENT`` (``1.0``, classic Zipf;
the CPython-corpus study fitted 0.65-0.81 for one hash column of natural
text, see docs/cache.md), ranks mapped to rows by a fixed random
permutation so hot rows are scattered over the table.

The cache holds ``CACHE_FRACTION`` (5 %) of the table in 8-way sets and is
warmed with :meth:`CachedRowStore.warm_up` on ``WARM_STEPS`` independent
batches of 8,192 tokens from the same distribution before timing.

Implementations, all on the same ids, compared bit for bit with ``host``:

- ``host``: the uncached host tier (the baseline);
- ``cached``: ``CachedRowStore.lookup`` on the warmed cache, never updated
  while timed (the hit rate at ``make`` time is in the params); on a GPU
  the host tier's rows are mapped for it, so the probe reads misses itself;
- ``cached[miss path]``: the same with ``read_misses=False`` (misses
  compacted, gathered by the host tier, scattered);
- ``cached+update``: a second, identically warmed cache; each call is a
  lookup followed by ``update()`` on a side stream, walking a pool of
  ``POOL`` fresh batches (the first call, the checked one, uses the case's
  ids), so it shows the steady state with maintenance included. The pool
  repeats during long timing loops, which favours the cache a little.

Ceiling: host-to-device copy of ``T * C * 264`` bytes (what an uncached
lookup of distinct rows would move).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engramrt.bench.registry import Case, Inputs, bf16_bits_check, register, table_params
from engramrt.lookup.synthetic import random_packed_rows
from engramrt.packed import row_bytes_for

E = 256
COLS = 24
ROW_BYTES = row_bytes_for(E)  # 264
ZIPF_EXPONENT = 1.0
CACHE_FRACTION = 0.05
WAYS = 8
WARM_STEPS = 32
WARM_TOKENS = 8192
POOL = {256: 256, 8192: 32}
_FILL_ROWS = 1 << 22

# One table and its samplers per run (filling 8 GiB is the slow part).
_STATE: dict[str, Any] = {}


class ZipfRows:
    """Row ids with ``P(rank r) ~ r ** -s``, ranks scattered over the rows by a permutation."""

    def __init__(self, num_rows: int, exponent: float, device: torch.device, seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        ranks = torch.arange(1, num_rows + 1, dtype=torch.float64, device=device)
        cdf = torch.cumsum(ranks.pow(-exponent), 0)
        self.cdf = cdf / cdf[-1]
        self.rows = torch.randperm(num_rows, device=device, generator=g)
        self.generator = g
        self.device = device

    def sample(self, shape: tuple[int, ...]) -> torch.Tensor:
        u = torch.rand(shape, dtype=torch.float64, device=self.device, generator=self.generator)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.rows.shape[0] - 1)
        return self.rows[rank].to(torch.int32)


def _state(num_rows: int, device: torch.device) -> dict[str, Any]:
    from engramrt.cache import CachedRowStore
    from engramrt.lookup.tiers import HostOptions, TablePlacement, make_store

    key = (num_rows, str(device))
    if _STATE.get("key") == key:
        return _STATE
    _STATE.clear()
    torch.cuda.empty_cache()
    store = make_store(
        TablePlacement(HostOptions(backend="triton"), device=device), num_rows=num_rows, E=E
    )
    generator = torch.Generator(device=device).manual_seed(4321)
    for start in range(0, num_rows, _FILL_ROWS):
        count = min(_FILL_ROWS, num_rows - start)
        store.write_rows(start, random_packed_rows(count, E, device, generator))
    sampler = ZipfRows(num_rows, ZIPF_EXPONENT, device, seed=99)
    warm = [sampler.sample((WARM_TOKENS, COLS)) for _ in range(WARM_STEPS)]
    capacity = int(CACHE_FRACTION * num_rows) * ROW_BYTES
    caches = []
    # "cached" and "cached[miss path]" stay frozen; "cached+update" evolves.
    for read_misses in (None, False, None):
        cache = CachedRowStore(
            store, capacity, WAYS, backend="triton", layer_id=1, read_misses=read_misses
        )
        cache.warm_up(warm)
        caches.append(cache)
    _STATE.update(key=key, store=store, sampler=sampler, caches=caches)
    return _STATE


def _make(
    num_tokens: int, num_rows: int, params: dict[str, Any]
) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        state = _state(num_rows, device)
        sampler: ZipfRows = state["sampler"]
        frozen, miss_path, updating = state["caches"]
        row_ids = sampler.sample((num_tokens, COLS))
        pool = [row_ids] + [sampler.sample((num_tokens, COLS)) for _ in range(POOL[num_tokens] - 1)]
        frozen.reset_stats()
        frozen.lookup(row_ids)
        # Reported with the results: the runner keeps this dict as the case's params.
        params["hit_rate"] = round(frozen.stats().hit_rate, 4)
        params["cache_slots"] = frozen.num_slots
        return {
            "row_ids": row_ids,
            "pool": pool,
            "step": [0],
            "store": state["store"],
            "frozen": frozen,
            "miss_path": miss_path,
            "updating": updating,
            "side_stream": torch.cuda.Stream(device),
            "out": {
                name: torch.empty((num_tokens, COLS, E), dtype=torch.bfloat16, device=device)
                for name in ("host", "cached", "cached[miss path]", "cached+update")
            },
        }

    return make


def _host(inputs: Inputs) -> torch.Tensor:
    return inputs["store"].lookup(inputs["row_ids"], out=inputs["out"]["host"])


def _cached(inputs: Inputs) -> torch.Tensor:
    return inputs["frozen"].lookup(inputs["row_ids"], out=inputs["out"]["cached"])


def _cached_miss_path(inputs: Inputs) -> torch.Tensor:
    return inputs["miss_path"].lookup(inputs["row_ids"], out=inputs["out"]["cached[miss path]"])


def _cached_update(inputs: Inputs) -> torch.Tensor:
    step = inputs["step"]
    row_ids = inputs["pool"][step[0] % len(inputs["pool"])]
    step[0] += 1
    cache = inputs["updating"]
    out = cache.lookup(row_ids, out=inputs["out"]["cached+update"])
    cache.update(stream=inputs["side_stream"])
    return out


# Every implementation's bf16 bits equal the uncached host tier's.
_check = bf16_bits_check("host")


@register
def cache_cases(quick: bool) -> list[Case]:
    table_bytes = (1 if quick else 8) << 30
    num_rows = table_bytes // ROW_BYTES + 1
    cases = []
    for num_tokens in (256, 8192):
        rows = num_tokens * COLS
        params: dict[str, Any] = {
            "tier": "host",
            "T": num_tokens,
            **table_params(num_rows, E, COLS),
            "cache_GiB": round(CACHE_FRACTION * num_rows * ROW_BYTES / 2**30, 3),
            "ways": WAYS,
            "ids": f"zipf s={ZIPF_EXPONENT} over rows (permuted), int32",
            "warm_up": f"{WARM_STEPS} x {WARM_TOKENS} tokens",
        }
        cases.append(
            Case(
                name=f"cache/host/T={num_tokens}",
                params=params,
                make=_make(num_tokens, num_rows, params),
                impls={
                    "host": _host,
                    "cached": _cached,
                    "cached[miss path]": _cached_miss_path,
                    "cached+update": _cached_update,
                },
                baseline="host",
                check=_check,
                bytes_moved=rows * ROW_BYTES,
                items=rows,
                item_name="rows",
                ceiling="h2d",
            )
        )
    return cases
