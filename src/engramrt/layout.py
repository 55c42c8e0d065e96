"""Hash layout: multipliers, primes and column offsets (SPEC §3).

Everything here is integer bookkeeping derived from an :class:`EngramConfig`
and the size of the compressed vocabulary; it is exact and deterministic.

Shapes (L = Engram layers, N = max n-gram, H = heads, C = (N-1)*H columns):

- ``multipliers [L, N]`` int64: odd multipliers of the rolling XOR hash;
- ``primes [L, N-1, H]`` int64: bucket count of each (layer, order, head);
- ``offsets [L, C]`` int64: first table row of each hash column;
- ``rows_needed [L]``: the sum of a layer's primes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from engramrt._primes import miller_rabin
from engramrt.config import EngramConfig
from engramrt.errors import LayoutError, ShardingError

__all__ = [
    "ColumnShard",
    "EngramLayout",
    "cols_per_rank",
    "is_prime",
    "next_unused_prime",
    "owned_columns",
]

_INT64_MAX = np.iinfo(np.int64).max
_TRIAL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61)


def is_prime(n: int) -> bool:
    """Primality of ``n``, for ``n < 4,759,123,141``.

    That bound covers every bucket count a config can ask for; a larger ``n`` is refused
    (:class:`LayoutError`). The test itself is the shared deterministic Miller-Rabin.
    """
    if n >= 4_759_123_141 and all(n % p for p in _TRIAL_PRIMES):  # a small factor answers
        raise LayoutError(f"primality test asked for n={n}; exact only below 4,759,123,141")
    return miller_rabin(n)


def next_unused_prime(after: int, used: set[int]) -> int:
    """The smallest prime ``> after`` that is not in ``used``."""
    candidate = after + 1
    while not (is_prime(candidate) and candidate not in used):
        candidate += 1
    return candidate


def cols_per_rank(num_cols: int, world: int) -> int:
    """``part = ceil(C / world)``, the columns each rank of ``world`` owns (SPEC §7).

    Refuses a ``world`` that leaves some rank with no column.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world <= 0:
        raise ShardingError(f"tp={world!r} must be a positive integer")
    part = -(-num_cols // world)
    if (world - 1) * part >= num_cols:
        owned = [max(0, min(part, num_cols - r * part)) for r in range(world)]
        raise ShardingError(
            f"tp={world} leaves rank(s) {[r for r, n in enumerate(owned) if n == 0]} without a "
            f"hash column: C={num_cols} columns in parts of ceil({num_cols}/{world})={part}; "
            f"choose tp so that (tp-1)*ceil(C/tp) < C"
        )
    return part


def owned_columns(num_cols: int, world: int, rank: int) -> tuple[int, int]:
    """``(col_begin, col_end)``: the hash columns ``rank`` of ``world`` owns (SPEC §7).

    The one place the column-ownership rule lives: rank ``r`` owns
    ``[r * part, min((r + 1) * part, C))`` with ``part = ceil(C / world)``.
    """
    part = cols_per_rank(num_cols, world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ShardingError(f"rank={rank!r} must be in [0, {world})")
    return rank * part, min((rank + 1) * part, num_cols)


@dataclass(frozen=True)
class ColumnShard:
    """The hash columns and table rows one tensor-parallel rank owns (SPEC §7).

    Columns of a layer are laid out contiguously, so a rank's columns
    ``[col_begin, col_end)`` own one contiguous row range ``[row_begin, row_end)``.
    """

    rank: int
    tp: int
    col_begin: int
    col_end: int
    row_begin: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_begin

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_begin


class EngramLayout:
    """Multipliers, primes and offsets of every Engram layer of a config.

    Args:
        config: the Engram config.
        seed: hash seed (SPEC §3); defaults to ``config.hash_seed`` (0).
        check_num_embeddings: refuse a config whose ``num_embeddings`` is
            smaller than the rows its primes need (on by default).
    """

    def __init__(
        self,
        config: EngramConfig,
        seed: int | None = None,
        *,
        check_num_embeddings: bool = True,
    ) -> None:
        self.config = config
        self.seed = int(config.hash_seed if seed is None else seed)
        self.multipliers = self._multipliers()
        self.primes = self._primes()
        self.offsets = np.zeros((config.n_layers, config.n_cols), dtype=np.int64)
        flat = self.primes.reshape(config.n_layers, config.n_cols)
        self.offsets[:, 1:] = np.cumsum(flat, axis=1)[:, :-1]
        self.rows_needed = flat.sum(axis=1).astype(np.int64)
        if check_num_embeddings:
            for i, layer in enumerate(config.layer_ids):
                have, need = config.num_embeddings[i], int(self.rows_needed[i])
                if have < need:
                    raise LayoutError(
                        f"engram_num_embeddings[{i}] (layer {layer}) = {have:,} is smaller than "
                        f"the {need:,} rows its hash columns need"
                    )
        self.multipliers.setflags(write=False)
        self.primes.setflags(write=False)
        self.offsets.setflags(write=False)
        self.rows_needed.setflags(write=False)

    # Construction -----------------------------------------------------------
    def _multipliers(self) -> np.ndarray:
        cfg = self.config
        bound = max(1, _INT64_MAX // cfg.compressed_vocab_size // 2)
        rows = []
        for layer in cfg.layer_ids:
            rng = np.random.default_rng(10007 * layer + self.seed)
            rows.append(rng.integers(0, bound, size=cfg.max_ngram_size, dtype=np.int64) * 2 + 1)
        return np.stack(rows).astype(np.int64)

    def _primes(self) -> np.ndarray:
        cfg = self.config
        primes = np.zeros((cfg.n_layers, cfg.max_ngram_size - 1, cfg.n_heads), dtype=np.int64)
        used: set[int] = set()
        for li in range(cfg.n_layers):
            for oi, vocab in enumerate(cfg.vocab_size):
                cur = vocab - 1
                for h in range(cfg.n_heads):
                    cur = next_unused_prime(cur, used)
                    used.add(cur)
                    primes[li, oi, h] = cur
        return primes

    # Accessors ----------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    @property
    def n_cols(self) -> int:
        return self.config.n_cols

    @property
    def max_ngram_size(self) -> int:
        return self.config.max_ngram_size

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @cached_property
    def col_primes(self) -> np.ndarray:
        """``[L, C]`` int64: the prime of each hash column (col = (n-2)*H + head)."""
        return self.primes.reshape(self.n_layers, self.n_cols)

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Rows each layer's table needs (the sum of its primes)."""
        return tuple(int(v) for v in self.rows_needed)

    def table_bytes(self, layer_index: int | None = None) -> int:
        """Bytes of one layer's fp8 table (all layers when ``layer_index`` is None).

        Uses the config's ``num_embeddings`` (the checkpoint's row count).
        """
        rows = self.config.num_embeddings
        if layer_index is None:
            return sum(rows) * self.config.row_bytes
        return rows[layer_index] * self.config.row_bytes

    def column_shard(self, layer_index: int, tp: int, rank: int) -> ColumnShard:
        """Columns and rows of layer ``layer_index`` owned by TP ``rank`` (SPEC §7)."""
        if not 0 <= layer_index < self.n_layers:
            raise ShardingError(f"layer_index={layer_index} must be in [0, {self.n_layers})")
        c0, c1 = owned_columns(self.n_cols, tp, rank)
        offsets = self.offsets[layer_index]
        primes = self.col_primes[layer_index]
        return ColumnShard(
            rank=rank,
            tp=tp,
            col_begin=c0,
            col_end=c1,
            row_begin=int(offsets[c0]),
            row_end=int(offsets[c1 - 1] + primes[c1 - 1]),
        )

    def cols_per_rank(self, tp: int) -> int:
        """``ceil(C / tp)``; refuses a tp that leaves some rank with no column."""
        return cols_per_rank(self.n_cols, tp)

    def to_dict(self) -> dict[str, object]:
        cfg = self.config
        return {
            "layer_ids": list(cfg.layer_ids),
            "max_ngram_size": cfg.max_ngram_size,
            "n_heads": cfg.n_heads,
            "n_cols": cfg.n_cols,
            "seed": self.seed,
            "multipliers": self.multipliers.tolist(),
            "primes": self.primes.tolist(),
            "offsets": self.offsets.tolist(),
            "num_embeddings": list(self.num_embeddings),
        }
