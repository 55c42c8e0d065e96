"""A hot-row cache in device memory in front of the host and disk tiers.

n-gram traffic is skewed: frequent n-grams hit the same rows again and
again. :class:`CachedRowStore` keeps the most frequently used packed rows
in a set-associative cache on the compute device and serves the rest from
the tier behind it, with the bytes of that tier's own lookup.

- :mod:`.policy`: the index (tags, sets, ways) and the admission/eviction
  policy (count-min sketch + per-slot counters, decayed), in plain torch;
  the hit-rate study simulates caches with this same code;
- :mod:`.reference` / :mod:`.kernel`: the probe + gather + dequantise of a
  lookup (plain torch definition, Triton kernel);
- :mod:`.backing`: how packed rows are read from each backing tier;
- :mod:`.store`: :class:`CachedRowStore` (lookup, update, warm-up) and the
  ordering argument that keeps lookups from seeing a half-replaced row;
- :mod:`.stats`: hits and misses per column and n-gram order.

Importing this package does not import Triton.
"""

from __future__ import annotations

from engramrt.cache.backing import packed_row_reader
from engramrt.cache.policy import (
    EMPTY_TAG,
    MISS,
    NOT_OWNED,
    AdmissionPlan,
    SetAssociativeLfu,
    mix32,
    probe_slots,
    set_index,
)
from engramrt.cache.reference import probe_gather_reference
from engramrt.cache.stats import CacheStats, order_of_column
from engramrt.cache.store import PHASES, CachedRowStore, CacheUpdate, cached_stores

__all__ = [
    "EMPTY_TAG",
    "MISS",
    "NOT_OWNED",
    "PHASES",
    "AdmissionPlan",
    "CacheStats",
    "CacheUpdate",
    "CachedRowStore",
    "SetAssociativeLfu",
    "cached_stores",
    "mix32",
    "order_of_column",
    "packed_row_reader",
    "probe_gather_reference",
    "probe_slots",
    "set_index",
]
