"""The cache over bf16 rows: fills and hits copy the stored bytes, so every gather through
it equals the backing's rows bit for bit whatever is cached; a byte changed in a slot
shows (hits do come from the slots); the fp8 lookup is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.cache.helpers import skewed_ids
from tests.helpers import TIERS, random_bf16_rows, random_packed_table

from engramrt.cache import CachedRowStore
from engramrt.errors import ValidationError
from engramrt.family import BF16
from engramrt.lookup.tiers import RowStore, TablePlacement, make_store


def bf16_backing(tier: str, rows: torch.Tensor, tmp_path: Path, device: torch.device) -> RowStore:
    return make_store(
        TablePlacement(tier, device), packed=rows, row_format=BF16, path=tmp_path / f"{tier}.rows"
    )


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("width", [12, 160])
@pytest.mark.parametrize("read_misses", [None, False], ids=["default", "miss-path"])
def test_gathers_through_the_cache_equal_the_backing(
    tier: str, width: int, read_misses: bool | None, tmp_path: Path, device: torch.device
) -> None:
    """Batches of skewed ids (repeats, any order, an empty one) with updates between: every
    gather equals the backing's rows, and hits, admissions and evictions happen."""
    num_rows = 300
    rows = random_bf16_rows(num_rows, width, seed=width)
    backing = bf16_backing(tier, rows, tmp_path, device)
    cache = CachedRowStore(backing, 6 * 4 * 2 * width, ways=4, read_misses=read_misses)
    assert cache.row_format == BF16 and cache.row_bytes == 2 * width and cache.num_slots == 24
    # Misses copied by the device from rows it reads in place (and updates in one launch of
    # whole-row word copies), or read from the backing after the host learns them.
    reads_in_place = read_misses is None and backing.device_rows() is not None
    assert cache.probe_reads_misses == reads_in_place
    g = torch.Generator().manual_seed(width)
    for count in (40, 1, 0, 64, 17, 50, 33, 64):
        ids = skewed_ids((count,), 0, num_rows, g)
        got = cache.gather_packed(ids.to(device))
        assert got.shape == (count, 2 * width) and got.device == cache.device
        assert torch.equal(got.cpu(), rows[ids])
        cache.update()
    stats = cache.stats()
    assert stats.hits[0] > 0 and stats.admitted > 0 and stats.evicted > 0
    assert stats.lookups == 269 and stats.row_bytes == 2 * width


@pytest.mark.parametrize("tier", ["device", "host"])
def test_warm_up_then_every_gather_hits_the_slots(
    tier: str, tmp_path: Path, device: torch.device
) -> None:
    """After a warm-up, rows served from the slots are the backing's; a byte changed in one
    slot shows in that row only (the control: hits really read the slots)."""
    rows = random_bf16_rows(200, 160, seed=1)
    backing = bf16_backing(tier, rows, tmp_path, device)
    cache = CachedRowStore(backing, 16 * 8 * 320, ways=8)
    corpus = [torch.arange(0, 40).view(10, 4)] * 3
    assert cache.warm_up(corpus) == 40
    ids = torch.tensor([39, 0, 7, 7, 21])
    assert torch.equal(cache.gather_packed(ids).cpu(), rows[ids])
    assert cache.stats().hits == (5,)
    slot = int(cache.policy.probe(torch.tensor([7], device=cache.device))[0])
    cache.cache_rows[slot, 101] ^= 0x01
    got = cache.gather_packed(ids).cpu()
    assert (got != rows[ids]).nonzero().tolist() == [[2, 101], [3, 101]]


def test_writes_drop_cached_copies(tmp_path: Path, device: torch.device) -> None:
    rows = random_bf16_rows(64, 12, seed=2)
    cache = CachedRowStore(bf16_backing("host", rows, tmp_path, device), 8 * 24 * 2, ways=2)
    ids = torch.tensor([3, 3, 9, 3, 9])
    for _ in range(3):
        cache.gather_packed(ids)
        cache.update()
    assert cache.stats().hits[0] > 0
    new = random_bf16_rows(1, 12, seed=3)
    cache.write_rows(3, new)
    expected = rows.clone()
    expected[3] = new[0]
    assert torch.equal(cache.gather_packed(ids).cpu(), expected[ids])


def test_the_fp8_lookup_is_refused_and_fp8_gathers_still_work(
    tmp_path: Path, device: torch.device
) -> None:
    cache = CachedRowStore(
        bf16_backing("device", random_bf16_rows(32, 160, 4), tmp_path, device), 8 * 320
    )
    with pytest.raises(
        ValidationError, match=r"lookup\(\) on CachedRowStore \(tier='cached'\) of bf16 rows"
    ):
        cache.lookup(torch.zeros((1, 2), dtype=torch.int64))
    # An fp8 cache: its stored rows through gather_packed too.
    table = random_packed_table(50, 64, seed=5)
    fp8 = CachedRowStore(make_store(TablePlacement("device", device), packed=table), 8 * 66)
    ids = torch.tensor([49, 0, 49, 12])
    for _ in range(2):
        assert torch.equal(fp8.gather_packed(ids).cpu(), table[ids])
        fp8.update()
    assert fp8.stats().hits[0] > 0
