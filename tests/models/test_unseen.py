"""Training positions shown as if their n-grams were new (``--unseen-rate``,
:class:`~engramrt_lab.models.train.UnseenNgrams`): which columns read other buckets, the
buckets drawn, the share, the seeded stream, and no gradient to the rows drawn."""

from __future__ import annotations

import torch

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants
from engramrt.layout import EngramLayout
from engramrt_lab.models.train import UnseenNgrams, unseen_rows_of
from engramrt_lab.training import EngramTable

CONSTS = HashConstants.from_layout(EngramLayout(PRESETS["tiny"]), pad_id=2)
CPU = torch.device("cpu")


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Row ids ``[B, S, L, C]`` int32, each inside its column's buckets."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.as_tensor(CONSTS.offsets)
    primes = torch.as_tensor(CONSTS.col_primes)
    draw = torch.rand((batch, seq, *offsets.shape), generator=g, dtype=torch.float64)
    return (offsets + (draw * primes).long()).to(torch.int32)


def test_every_hit_position_reads_other_buckets_from_one_order_up() -> None:
    """With every position hit: per position one first order k, the same in every layer;
    the columns of order >= k read a bucket of their own column (own = -1 there), the
    others keep their ids (other = -1 there)."""
    ids = _ids(16, 32)
    own, other = UnseenNgrams.of(0.999999, CONSTS, seed=1, device=CPU).split(ids)
    heads = CONSTS.n_heads
    order = torch.arange(ids.shape[-1]) // heads
    new = other >= 0
    assert torch.equal(new, own < 0)  # each column is one or the other
    assert torch.equal(torch.where(new, ids.long(), own), ids.long())  # kept ids unchanged
    firsts = set()
    for b in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            pattern = new[b, s]
            assert torch.equal(pattern[0], pattern[1])  # both layers alike
            first = int(order[pattern[0]].min())
            assert torch.equal(pattern[0], order >= first)
            firsts.add(first)
    assert firsts == {0, 1, 2}  # each first order drawn
    offsets = torch.as_tensor(CONSTS.offsets).expand_as(other)
    primes = torch.as_tensor(CONSTS.col_primes).expand_as(other)
    drawn = other[new]
    assert bool(((drawn >= offsets[new]) & (drawn < offsets[new] + primes[new])).all())
    # Control: the drawn buckets are not the ids they replace (a handful may coincide).
    assert (drawn == ids.long()[new]).float().mean() < 0.01


def test_the_share_of_positions_and_the_seeded_stream() -> None:
    """About ``rate`` of the positions are hit (20,480 positions: three standard deviations
    are 0.009); the same seed draws the same split, another seed another one, and rate 0
    keeps every id."""
    ids = _ids(40, 512, seed=3)
    own, other = UnseenNgrams.of(0.25, CONSTS, seed=7, device=CPU).split(ids)
    hit = (other >= 0).any(dim=-1).any(dim=-1)
    assert abs(hit.float().mean().item() - 0.25) < 0.015
    again = UnseenNgrams.of(0.25, CONSTS, seed=7, device=CPU).split(ids)
    assert torch.equal(again[0], own) and torch.equal(again[1], other)
    assert not torch.equal(UnseenNgrams.of(0.25, CONSTS, seed=8, device=CPU).split(ids)[1], other)
    kept, none = UnseenNgrams.of(0.0, CONSTS, seed=7, device=CPU).split(ids)
    assert torch.equal(kept, ids.long()) and bool((none == -1).all())


def test_the_rows_drawn_get_no_gradient() -> None:
    """The rows read at the new columns are the drawn buckets' rows, and the tables'
    gradient holds only the kept ids. Control: reading the same mixed ids plainly puts
    the drawn buckets in the gradient."""
    ids = _ids(2, 8, seed=5)
    own, other = UnseenNgrams.of(0.5, CONSTS, seed=2, device=CPU).split(ids)
    rows_needed = int(CONSTS.offsets[0, -1] + CONSTS.col_primes[0, -1])
    table = EngramTable(rows_needed, 32, device=CPU)
    cols = ids.shape[-1]
    rows = unseen_rows_of(lambda index, x: table(x), other)(0, own[:, :, 0].reshape(-1, cols))
    mixed = torch.where(other >= 0, other, own)[:, :, 0].reshape(-1, cols)
    assert torch.equal(rows, table(mixed))
    rows.sum().backward()
    grad = table.weight.grad.coalesce()
    kept = set(own[:, :, 0][own[:, :, 0] >= 0].tolist())
    drawn_only = set(other[:, :, 0][other[:, :, 0] >= 0].tolist()) - kept
    assert drawn_only and set(grad.indices()[0].tolist()) == kept
    table.weight.grad = None
    table(mixed).sum().backward()
    assert drawn_only <= set(table.weight.grad.coalesce().indices()[0].tolist())
