"""Stores over a shared table's rows, and loading a checkpoint's shard once per node.

The host-gather store serves the mapping itself (same address: no copy)
with the reference lookup's bytes; the UVA store needs a CUDA device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tests.distributed.common import (
    C10,
    TINY,
    assert_same_bits,
    layer_table,
    random_row_ids,
    sha256_of,
)

from engramrt.checkpoint import save_tables
from engramrt.distributed import (
    SharedHostTable,
    SharedRows,
    checkpoint_fingerprint,
    load_shared_table,
    shared_store,
)
from engramrt.errors import CapacityError, ValidationError
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import HostGatherRowStore, HostOptions, TablePlacement


def shard_table(directory: Path, config, tp: int, rank: int) -> SharedHostTable:
    shard = EngramLayout(config).column_shard(0, tp, rank)
    rows = layer_table(config)[shard.row_begin : shard.row_end]
    return SharedHostTable.create_or_attach(
        f"shard-{rank}-of-{tp}",
        rows.shape[0],
        rows.shape[1],
        lambda target: target.copy_(rows),
        directory=directory,
    )


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("config", [TINY, C10], ids=["tiny", "c10"])
def test_host_gather_store_serves_the_mapping_without_copying(
    tmp_path: Path, config, backend: str
) -> None:
    tp, rank = 3, 1
    shard = EngramLayout(config).column_shard(0, tp, rank)
    table = shard_table(tmp_path, config, tp, rank)
    options = HostOptions(backend=backend, chunk_rows=5)  # several pipelined pieces
    store = shared_store(table, TablePlacement(options, "cpu", tp, rank), shard=shard)
    assert isinstance(store, HostGatherRowStore) and isinstance(store.host_rows, SharedRows)
    assert store.source.data_ptr() == table.rows.data_ptr()  # the mapping, not a copy
    for num_tokens in (9, 1, 0):
        row_ids = random_row_ids(config, num_tokens, seed=num_tokens)
        expected = lookup_rows_reference(
            row_ids, layer_table(config), config.head_dim, shard.col_begin, shard.col_end
        )
        assert_same_bits(store.lookup(row_ids), expected, label=f"T={num_tokens}")
    with pytest.raises(ValidationError, match="write_rows on a store over shared rows"):
        store.write_rows(0, table.rows[:1].clone())


def test_a_row_slice_of_a_table_serves_its_rows(tmp_path: Path) -> None:
    """One whole-layer table; each rank's store serves its shard's rows of it."""
    table_rows = layer_table(TINY)
    table = SharedHostTable.create_or_attach(
        "whole", *table_rows.shape, lambda t: t.copy_(table_rows), directory=tmp_path
    )
    row_ids = random_row_ids(TINY, 6, seed=3)
    for rank in range(4):
        shard = EngramLayout(TINY).column_shard(0, 4, rank)
        store = shared_store(
            table,
            TablePlacement(HostOptions(backend="reference"), "cpu", 4, rank),
            rows_slice=slice(shard.row_begin, shard.row_end),
            shard=shard,
        )
        expected = lookup_rows_reference(
            row_ids, table_rows, TINY.head_dim, shard.col_begin, shard.col_end
        )
        assert_same_bits(store.lookup(row_ids), expected, label=f"rank {rank}")


def test_other_tiers_are_refused(tmp_path: Path) -> None:
    table = shard_table(tmp_path, C10, 2, 0)
    with pytest.raises(ValidationError, match="tier='device'; expected one of host, uva"):
        shared_store(table, TablePlacement("device"))
    if torch.cuda.is_available():
        pytest.skip("with a CUDA device the UVA store builds (GPU test)")
    with pytest.raises(CapacityError, match="needs a CUDA device"):
        shared_store(table, TablePlacement("uva", "cpu"))
    with pytest.raises(ValidationError, match="expected contiguous CPU uint8"):
        shared_store(table.rows[::2], TablePlacement("host", "cpu"))
    with pytest.raises(ValidationError, match=r"shard holds \d+ rows; expected the table's"):
        shared_store(
            table, TablePlacement("host", "cpu"), shard=EngramLayout(C10).column_shard(0, 1, 0)
        )


def test_load_shared_table_reads_the_checkpoint_once(tmp_path: Path) -> None:
    tables = [layer_table(TINY, i) for i in range(TINY.n_layers)]
    checkpoint = save_tables(tmp_path / "engram.safetensors", tables, TINY)
    shm = tmp_path / "shm"
    tp, rank, layer_index = 2, 1, 1
    shard = EngramLayout(TINY).column_shard(layer_index, tp, rank)
    stores = [
        load_shared_table(
            checkpoint,
            TINY,
            layer_index,
            TablePlacement(HostOptions(backend="reference"), "cpu", tp, rank),
            directory=shm,
        )
        for _ in range(2)
    ]
    first, second = (store.host_rows.owner for store in stores)  # type: ignore[attr-defined]
    assert first.created and not second.created and first.path == second.path
    assert sha256_of(second.rows) == sha256_of(tables[layer_index][shard.row_begin : shard.row_end])
    row_ids = random_row_ids(TINY, 8, seed=1, layer_index=layer_index)
    expected = lookup_rows_reference(
        row_ids, tables[layer_index], TINY.head_dim, shard.col_begin, shard.col_end
    )
    for store in stores:
        assert (store.col_begin, store.col_end) == (shard.col_begin, shard.col_end)
        assert_same_bits(store.lookup(row_ids), expected, label="shared checkpoint shard")
    # Another checkpoint file (here: touched) is another table, not the old one.
    before = checkpoint_fingerprint(checkpoint, TINY, layer_index, shard)
    os.utime(checkpoint, ns=(1, 1))
    assert checkpoint_fingerprint(checkpoint, TINY, layer_index, shard) != before
    third = load_shared_table(
        checkpoint, TINY, layer_index, TablePlacement("host", "cpu", tp, rank), directory=shm
    )
    assert third.host_rows.owner.created  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudaHostRegister needs a GPU")
def test_uva_store_reads_the_registered_read_only_mapping(tmp_path: Path) -> None:
    """The PROT_READ mapping is registered read-only and the kernel reads it in place."""
    tp, rank = 2, 1
    shard = EngramLayout(C10).column_shard(0, tp, rank)
    table = shard_table(tmp_path, C10, tp, rank)
    store = shared_store(table, TablePlacement("uva", "cuda", tp, rank), shard=shard)
    assert store.host_table.data_ptr() == table.rows.data_ptr()  # the mapping, not a copy
    assert table.register_cuda() is table.rows  # once per process
    for num_tokens in (9, 1):
        row_ids = random_row_ids(C10, num_tokens, seed=20 + num_tokens)
        expected = lookup_rows_reference(
            row_ids, layer_table(C10), C10.head_dim, shard.col_begin, shard.col_end
        )
        got = store.lookup(row_ids.cuda()).cpu()
        assert_same_bits(got, expected, label=f"uva T={num_tokens}")
