"""Hit and miss counts of a cache, per hash column and n-gram order.

Hash column ``col`` of a layer serves n-grams of order ``col // n_heads + 2``
(SPEC §3: column ``(n-2)*H + head``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CacheStats", "order_of_column"]


def order_of_column(col: int, n_heads: int) -> int:
    """The n-gram order a hash column serves."""
    return col // n_heads + 2


@dataclass(frozen=True)
class CacheStats:
    """Counts since the cache was built (or since ``reset_stats``).

    Attributes:
        layer_id: the Engram layer this cache serves (a label; may be None).
        n_heads: hash heads per order, to map columns to orders.
        row_bytes: bytes of one packed row (264 for E=256).
        hits, misses: per hash column, owned lookups that were / were not
            served from the cache (every lookup of a row counts, duplicates
            in a batch included).
        rows_fetched: rows read from the backing tier: per lookup call its
            distinct missed rows (the miss path deduplicates within a batch,
            as the backing tier does), or, where the probe reads misses
            itself (:attr:`CachedRowStore.probe_reads_misses`), every missed
            lookup plus the rows updates admitted.
        admitted: rows written into the cache by updates.
        evicted: admissions that replaced a resident row.
    """

    layer_id: int | None
    n_heads: int
    row_bytes: int
    hits: tuple[int, ...]
    misses: tuple[int, ...]
    rows_fetched: int
    admitted: int
    evicted: int

    @property
    def lookups(self) -> int:
        return sum(self.hits) + sum(self.misses)

    @property
    def hit_rate(self) -> float:
        """Hits over owned lookups (0.0 before any lookup)."""
        total = self.lookups
        return sum(self.hits) / total if total else 0.0

    @property
    def bytes_saved(self) -> int:
        """Packed-row bytes the cache served instead of the backing tier (hits x row bytes).

        Counted per lookup; the host tier deduplicates rows within a batch,
        so its PCIe traffic falls by less when hits repeat in a batch
        (``rows_fetched`` is what it actually moved).
        """
        return sum(self.hits) * self.row_bytes

    def by_order(self) -> dict[int, dict[str, float]]:
        """``{order: {"hits", "misses", "hit_rate", "bytes_saved"}}`` over the columns of each order."""
        result: dict[int, dict[str, float]] = {}
        for col, (hit, miss) in enumerate(zip(self.hits, self.misses, strict=True)):
            entry = result.setdefault(order_of_column(col, self.n_heads), {"hits": 0, "misses": 0})
            entry["hits"] += hit
            entry["misses"] += miss
        for entry in result.values():
            total = entry["hits"] + entry["misses"]
            entry["hit_rate"] = entry["hits"] / total if total else 0.0
            entry["bytes_saved"] = entry["hits"] * self.row_bytes
        return result

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: totals, per order, per column."""
        return {
            "layer_id": self.layer_id,
            "lookups": self.lookups,
            "hits": sum(self.hits),
            "misses": sum(self.misses),
            "hit_rate": self.hit_rate,
            "bytes_saved": self.bytes_saved,
            "rows_fetched": self.rows_fetched,
            "admitted": self.admitted,
            "evicted": self.evicted,
            "by_order": {str(order): entry for order, entry in self.by_order().items()},
            "hits_per_column": list(self.hits),
            "misses_per_column": list(self.misses),
        }
