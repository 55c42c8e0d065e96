"""The collective paths over NCCL in a world of one GPU.

Several GPUs are needed to exchange anything, but one already runs every
NCCL call the lookups make (all-gather, all-reduce and all-to-all on int32
or int64 words, counts exchanged before sizes are known) on CUDA tensors
from every tier, which gloo on the CPU cannot show.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests.distributed.common import (
    C10,
    assert_same_bits,
    layer_table,
    random_row_ids,
    reference_rows,
)

from engramrt.exchange import AllGatherExchange, AllToAllExchange
from engramrt.exchange._collectives import all_gather_into, word_view
from engramrt.lookup.tiers import TablePlacement, make_store, tier_class

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
    reason="NCCL needs a GPU",
)


@pytest.mark.parametrize("tier", ["device", "uva", "host"])
def test_lookups_over_nccl_equal_the_reference(nccl_world_of_one, tier: str) -> None:
    options = tier_class(tier).options_type(backend="triton")  # type: ignore[call-arg]
    store = make_store(TablePlacement(options, device="cuda"), packed=layer_table(C10, 0))
    row_ids = random_row_ids(C10, 37, seed=3)
    expected = reference_rows(C10, row_ids)
    ids = row_ids.cuda()
    for collective in ("all_gather", "all_reduce"):
        lookup = AllGatherExchange(
            store, num_cols=C10.n_cols, group=nccl_world_of_one, collective=collective
        )
        assert_same_bits(lookup.fetch(ids).cpu(), expected, label=f"{tier} tp=1 {collective}")
    a2a = AllToAllExchange(store, num_cols=C10.n_cols, group=nccl_world_of_one)
    assert_same_bits(a2a.fetch(ids).cpu(), expected, label=f"{tier} all-to-all")
    assert a2a.fetch(ids[:0]).shape == (0, C10.n_cols, C10.head_dim)


def test_word_collectives_over_nccl_keep_the_bits(nccl_world_of_one) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    rows = torch.randn((6, 4, 64), device="cuda", generator=g).bfloat16()
    rows[0, 0, :4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-40])
    gathered = torch.empty((1, *rows.shape), dtype=rows.dtype, device="cuda")
    all_gather_into(word_view(gathered), word_view(rows), nccl_world_of_one)
    assert torch.equal(gathered[0].view(torch.int16), rows.view(torch.int16))
    summed = rows.clone()
    dist.all_reduce(word_view(summed), op=dist.ReduceOp.SUM, group=nccl_world_of_one)
    assert torch.equal(summed.view(torch.int16), rows.view(torch.int16))
