"""The layout checked against independent computations (a sieve, Python ints)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.errors import LayoutError, ShardingError
from engramrt.layout import EngramLayout, is_prime, next_unused_prime


def _sieve_primes(lo: int, hi: int) -> list[int]:
    """Primes in [lo, hi) by a segmented sieve of Eratosthenes (independent of Miller-Rabin)."""
    small_limit = int(hi**0.5) + 1
    small = np.ones(small_limit + 1, dtype=bool)
    small[:2] = False
    for p in range(2, int(small_limit**0.5) + 1):
        if small[p]:
            small[p * p :: p] = False
    seg = np.ones(hi - lo, dtype=bool)
    for p in np.flatnonzero(small):
        start = max(p * p, (lo + p - 1) // p * p)
        seg[start - lo :: p] = False
    if lo < 2:
        seg[: 2 - lo] = False
    return (np.flatnonzero(seg) + lo).tolist()


def test_miller_rabin_matches_sieve_below_200k() -> None:
    primes = set(_sieve_primes(0, 200_000))
    assert all(is_prime(n) == (n in primes) for n in range(200_000))


@pytest.mark.parametrize(
    "n",
    [2047, 1_373_653, 25_326_001, 3_215_031_751, 2_152_302_898_747 % 4_759_123_141, 561, 41041],
)
def test_miller_rabin_rejects_pseudoprimes(n: int) -> None:
    # Strong pseudoprimes to small bases and Carmichael numbers: composite by
    # trial division, so the test must say False.
    has_factor = any(n % p == 0 for p in range(2, int(n**0.5) + 1))
    assert has_factor
    assert not is_prime(n)


def test_next_unused_prime_skips_used() -> None:
    assert next_unused_prime(10, set()) == 11
    assert next_unused_prime(10, {11, 13}) == 17


def test_dsv41_flash_layout_against_sieve_and_published_sums() -> None:
    cfg = PRESETS["dsv41-flash"]
    layout = EngramLayout(cfg)
    # Published row counts of V4.1-Flash (engram_num_embeddings).
    assert layout.num_embeddings == (384_006_168, 384_016_682)
    # Every order has vocab 16e6, so the 48 primes are the 48 consecutive
    # primes above 15,999,999, handed out layer, order, head in order.
    expected = _sieve_primes(16_000_000, 16_002_000)[: 2 * 3 * 8]
    assert layout.primes.ravel().tolist() == expected
    for li in range(2):
        running = 0
        for col in range(24):
            assert layout.offsets[li, col] == running
            running += int(layout.col_primes[li, col])
        assert running == layout.num_embeddings[li]
    assert int(layout.offsets.max() + layout.col_primes.max()) < 2**31  # int32 holds row ids


def test_primes_are_distinct_across_layers_with_mixed_vocab() -> None:
    cfg = PRESETS["tiny"].replace(vocab_size=(100, 90, 100), num_embeddings=(10**6, 10**6))
    layout = EngramLayout(cfg)
    flat = layout.primes.ravel().tolist()
    assert len(set(flat)) == len(flat)
    sieve = _sieve_primes(0, 1000)
    # layer 0, order 2 (vocab 100): the first 4 primes > 99; order 3 (vocab
    # 90): the first 4 primes > 89 that order 2 did not take.
    order2 = [p for p in sieve if p > 99][:4]
    assert order2 == [101, 103, 107, 109]
    assert layout.primes[0, 0].tolist() == order2
    assert layout.primes[0, 1].tolist() == [p for p in sieve if p > 89 and p not in order2][:4]


def test_multipliers_against_python_int_formula() -> None:
    cfg = PRESETS["dsv41-flash"]
    layout = EngramLayout(cfg)
    bound = max(1, (2**63 - 1) // 99_092 // 2)  # Python ints: no overflow question
    for li, layer in enumerate(cfg.layer_ids):
        rng = np.random.Generator(np.random.PCG64(10007 * layer + 0))
        draws = [int(v) for v in rng.integers(0, bound, size=4, dtype=np.int64)]
        assert layout.multipliers[li].tolist() == [d * 2 + 1 for d in draws]
        for m in layout.multipliers[li].tolist():
            assert m % 2 == 1 and 1 <= m < 2 * bound
            assert m * (99_092 - 1) < 2**63  # id * m never overflows int64
    assert layout.multipliers.dtype == np.int64
    other = EngramLayout(cfg, seed=1)
    assert not np.array_equal(other.multipliers, layout.multipliers)
    assert np.array_equal(other.primes, layout.primes)


def test_layout_refuses_too_few_rows() -> None:
    cfg = PRESETS["tiny"].replace(num_embeddings=(49_796, 50_979))
    with pytest.raises(LayoutError) as info:
        EngramLayout(cfg)
    msg = str(info.value)
    assert "layer 3" in msg and "50,979" in msg and "50,980" in msg


def test_column_shard_rows_are_contiguous_and_cover_table() -> None:
    layout = EngramLayout(PRESETS["dsv41-flash"])
    for tp in (1, 2, 3, 4, 5, 6, 8, 12, 24):
        for li in range(2):
            shards = [layout.column_shard(li, tp, r) for r in range(tp)]
            assert shards[0].row_begin == 0 and shards[0].col_begin == 0
            assert shards[-1].col_end == 24
            assert shards[-1].row_end == layout.num_embeddings[li]
            for a, b in itertools.pairwise(shards):
                assert a.row_end == b.row_begin and a.col_end == b.col_begin
                assert a.num_cols == -(-24 // tp)


@pytest.mark.parametrize("tp", [7, 9, 10, 11, 13, 25])
def test_tp_leaving_a_rank_without_columns_is_refused(tp: int) -> None:
    layout = EngramLayout(PRESETS["dsv41-flash"])
    with pytest.raises(ShardingError, match=f"tp={tp}"):
        layout.cols_per_rank(tp)


@pytest.mark.parametrize("tp", [0, -1])
def test_non_positive_tp_is_refused(tp: int) -> None:
    with pytest.raises(ShardingError, match="positive"):
        EngramLayout(PRESETS["tiny"]).cols_per_rank(tp)
