"""Loading a rank's rows from fp8 checkpoints, and writing them with ``save_tables``."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open

import engramrt
from engramrt.checkpoint import (
    SafetensorsStreamWriter,
    iter_packed_rows,
    load_table,
    load_tables,
    read_header,
    read_table,
    save_tables,
)
from engramrt.checkpoint import reader as reader_module
from engramrt.errors import CapacityError, CheckpointError, ValidationError
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement, make_store, tier_class

from .conftest import SCALE, WEIGHT, write_deepseek_checkpoint, write_sharded_directory


def _valid_tps(config, limit=6):
    layout = EngramLayout(config)
    valid = []
    for tp in range(1, limit + 1):
        try:
            layout.cols_per_rank(tp)
        except engramrt.ShardingError:
            continue
        valid.append(tp)
    return valid


def _deepseek_tensors(config, packed, scale_dtype=torch.float8_e8m0fnu):
    E = config.head_dim
    tensors = {}
    for layer, table in zip(config.layer_ids, packed, strict=True):
        tensors[WEIGHT.format(layer=layer)] = table[:, :E].contiguous().view(torch.float8_e4m3fn)
        tensors[SCALE.format(layer=layer)] = table[:, E:].contiguous().view(scale_dtype)
    return tensors


# --- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_tiny_rank_shards_equal_slices_of_the_full_table(tmp_path, tiny, tiny_tables, tp) -> None:
    _, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "model.safetensors", tiny, packed)
    layout = EngramLayout(tiny)
    for layer_index in range(tiny.n_layers):
        covered = 0
        for rank in range(tp):
            shard = layout.column_shard(layer_index, tp, rank)
            got = read_table(path, tiny, layer_index, tp=tp, rank=rank, block_rows=4099)
            assert torch.equal(got, packed[layer_index][shard.row_begin : shard.row_end])
            covered += got.shape[0]
        assert covered == int(layout.rows_needed[layer_index])


def test_uint8_and_e8m0_scales_load_identically(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    as_e8m0 = write_deepseek_checkpoint(tmp_path / "e8m0.safetensors", small, packed)
    as_uint8 = write_deepseek_checkpoint(
        tmp_path / "u8.safetensors", small, packed, scale_dtype=torch.uint8
    )
    assert read_header(as_e8m0).tensors[SCALE.format(layer=5)].dtype == "F8_E8M0"
    assert read_header(as_uint8).tensors[SCALE.format(layer=5)].dtype == "U8"
    for layer_index in range(small.n_layers):
        a = read_table(as_e8m0, small, layer_index, tp=2, rank=1)
        b = read_table(as_uint8, small, layer_index, tp=2, rank=1)
        assert torch.equal(a, b)


@pytest.mark.parametrize("scale_dtype", ["uint8", "e8m0"])
@pytest.mark.parametrize("form", ["packed", "pair", "mapping"])
def test_save_tables_round_trips_bit_exactly(tmp_path, small, small_tables, scale_dtype, form):
    _, packed = small_tables
    E = small.head_dim
    if form == "packed":
        tables = packed
    elif form == "pair":
        tables = [(t[:, :E].view(torch.float8_e4m3fn), t[:, E:]) for t in packed]
    else:
        tables = dict(zip(small.layer_ids, packed, strict=True))
    path = save_tables(
        tmp_path / "out.safetensors",
        tables,
        small,
        scale_dtype=scale_dtype,
        block_rows=17,
        metadata={"source": "test"},
    )
    scale_torch = torch.uint8 if scale_dtype == "uint8" else torch.float8_e8m0fnu
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        for layer, table in zip(small.layer_ids, packed, strict=True):
            weight = f.get_tensor(WEIGHT.format(layer=layer))
            scales = f.get_tensor(SCALE.format(layer=layer))
            assert weight.dtype == torch.float8_e4m3fn and scales.dtype == scale_torch
            assert torch.equal(weight.view(torch.uint8), table[:, :E])
            assert torch.equal(scales.view(torch.uint8), table[:, E:])
    assert metadata["engramrt_version"] == engramrt.__version__
    assert metadata["engramrt_config"] == "synthetic"
    assert metadata["source"] == "test"
    layers = json.loads(metadata["engramrt_layers"])
    assert [entry["row_end"] - entry["row_begin"] for entry in layers] == list(small.num_embeddings)
    assert json.loads(metadata["engramrt_config_json"]) == small.to_hf_dict()
    for tp in _valid_tps(small):
        for rank in range(tp):
            shard = EngramLayout(small).column_shard(2, tp, rank)
            got = read_table(path, small, 2, tp=tp, rank=rank)
            assert torch.equal(got, packed[2][shard.row_begin : shard.row_end])


def test_per_rank_files_load_their_shard_and_stitch_for_other_tps(tmp_path, small, small_tables):
    """save_tables(tp=3) writes rank files; tp=3, tp=2 and tp=1 readers all get exact rows."""
    _, packed = small_tables
    layout = EngramLayout(small)
    directory = tmp_path / "ranks"
    for rank in range(3):
        shards = [layout.column_shard(i, 3, rank) for i in range(small.n_layers)]
        tables = [t[s.row_begin : s.row_end] for t, s in zip(packed, shards, strict=True)]
        save_tables(directory / f"rank{rank}.safetensors", tables, small, tp=3, rank=rank)
        header = read_header(directory / f"rank{rank}.safetensors")
        entry = header.tensors[WEIGHT.format(layer=0)]
        assert entry.shape == (shards[0].num_rows, small.head_dim)  # only this rank's rows
        assert header.metadata["engramrt_tp"] == "3"
        assert header.metadata["engramrt_rank"] == str(rank)
    for tp in (1, 2, 3):
        for rank in range(tp):
            for layer_index in range(small.n_layers):
                shard = layout.column_shard(layer_index, tp, rank)
                got = read_table(directory, small, layer_index, tp=tp, rank=rank, block_rows=10)
                assert torch.equal(got, packed[layer_index][shard.row_begin : shard.row_end])


def test_missing_rank_file_names_the_rows_not_covered(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    layout = EngramLayout(small)
    for rank in (0, 2):  # rank 1's file is missing
        shards = [layout.column_shard(i, 3, rank) for i in range(small.n_layers)]
        tables = [t[s.row_begin : s.row_end] for t, s in zip(packed, shards, strict=True)]
        save_tables(tmp_path / f"rank{rank}.safetensors", tables, small, tp=3, rank=rank)
    missing = layout.column_shard(0, 3, 1)
    with pytest.raises(
        CheckpointError, match=f"no weight tensor holds global row {missing.row_begin}"
    ):
        read_table(tmp_path, small, 0, tp=1, rank=0)


def test_sharded_directory_with_and_without_index(tmp_path, tiny, tiny_tables) -> None:
    """DeepSeek-style: tensors spread over files, weight and scale of a layer apart."""
    _, packed = tiny_tables
    tensors = _deepseek_tensors(tiny, packed, scale_dtype=torch.uint8)
    g = torch.Generator().manual_seed(5)
    files = {
        "model-00001-of-00003.safetensors": {
            "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            WEIGHT.format(layer=1): tensors[WEIGHT.format(layer=1)],
        },
        "model-00002-of-00003.safetensors": {
            SCALE.format(layer=1): tensors[SCALE.format(layer=1)],
            WEIGHT.format(layer=3): tensors[WEIGHT.format(layer=3)],
        },
        "model-00003-of-00003.safetensors": {
            SCALE.format(layer=3): tensors[SCALE.format(layer=3)],
            "lm_head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        },
    }
    layout = EngramLayout(tiny)
    for index in (True, False):
        directory = write_sharded_directory(tmp_path / f"index-{index}", files, index=index)
        for layer_index in range(tiny.n_layers):
            for tp, rank in ((1, 0), (4, 3)):
                shard = layout.column_shard(layer_index, tp, rank)
                got = read_table(directory, tiny, layer_index, tp=tp, rank=rank)
                assert torch.equal(got, packed[layer_index][shard.row_begin : shard.row_end])


def test_index_pointing_at_a_missing_or_wrong_file(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    tensors = _deepseek_tensors(small, packed)
    directory = write_sharded_directory(tmp_path / "ckpt", {"a.safetensors": tensors}, index=True)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][WEIGHT.format(layer=5)] = "gone.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"maps tensor 'layers.5.*gone.safetensors"):
        read_table(directory, small, 1)
    index["weight_map"][WEIGHT.format(layer=5)] = "b.safetensors"
    index_path.write_text(json.dumps(index))
    write_sharded_directory(directory, {"b.safetensors": {"other": torch.ones(2)}}, index=False)
    with pytest.raises(CheckpointError, match="whose header lacks it"):
        read_table(directory, small, 1)


# --- into storage tiers, in bounded blocks -------------------------------------------


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_load_table_into_tiers_serves_the_reference_lookup(tmp_path, tiny, tiny_tables, tier):
    _, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "model.safetensors", tiny, packed)
    layout = EngramLayout(tiny)
    tp, rank, layer_index = 3, 1, 1
    options = tier_class(tier).options_type(backend="reference")  # type: ignore[call-arg]
    placement = TablePlacement(options, device="cpu", tp=tp, rank=rank, disk_dir=tmp_path)
    store = load_table(path, tiny, layer_index, placement, block_rows=5000)
    shard = layout.column_shard(layer_index, tp, rank)
    assert (store.tier, store.row_begin, store.row_end) == (tier, shard.row_begin, shard.row_end)
    g = torch.Generator().manual_seed(9)
    offsets = torch.from_numpy(layout.offsets[layer_index].copy())
    primes = torch.from_numpy(layout.col_primes[layer_index].copy())
    row_ids = offsets + (torch.rand(33, tiny.n_cols, generator=g) * primes).long()  # [T, C]
    want = lookup_rows_reference(
        row_ids, packed[layer_index], tiny.head_dim, shard.col_begin, shard.col_end
    )
    assert torch.equal(store.lookup(row_ids).view(torch.int16), want.view(torch.int16))


def test_load_tables_every_layer(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    path = write_deepseek_checkpoint(tmp_path / "m.safetensors", small, packed)
    stores = load_tables(path, small, TablePlacement("host", device="cpu", tp=2, rank=0))
    layout = EngramLayout(small)
    for layer_index, store in enumerate(stores):
        shard = layout.column_shard(layer_index, 2, 0)
        assert torch.equal(store.source, packed[layer_index][shard.row_begin : shard.row_end])


def test_loading_reads_only_shard_rows_in_bounded_blocks(tmp_path, tiny, tiny_tables, monkeypatch):
    _, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "model.safetensors", tiny, packed)
    shard = EngramLayout(tiny).column_shard(0, 4, 2)
    reads: list[tuple[str, int, int]] = []

    class RecordingSlice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getitem__(self, rows):
            reads.append((self.name, rows.start, rows.stop))
            return self.inner[rows]

    real = reader_module.safe_slice
    monkeypatch.setattr(
        reader_module,
        "safe_slice",
        lambda file, name, open_path="": RecordingSlice(name, real(file, name, open_path)),
    )
    writes: list[tuple[int, int]] = []
    placement = TablePlacement("host", device="cpu", tp=4, rank=2)
    store = make_store(placement, E=tiny.head_dim, shard=shard)
    real_write = store.write_rows

    def recording_write(start, rows):
        writes.append((start, rows.shape[0]))
        real_write(start, rows)

    monkeypatch.setattr(store, "write_rows", recording_write)
    block_rows = 777
    load_table(path, tiny, 0, placement, store=store, block_rows=block_rows)
    assert torch.equal(store.source, packed[0][shard.row_begin : shard.row_end])
    assert {name for name, _, _ in reads} == {WEIGHT.format(layer=1), SCALE.format(layer=1)}
    for _, start, stop in reads:
        assert shard.row_begin <= start < stop <= shard.row_end
        assert stop - start <= block_rows
    assert sum(stop - start for _, start, stop in reads) == 2 * shard.num_rows  # nothing twice
    assert all(n <= block_rows for _, n in writes)
    assert sum(n for _, n in writes) == shard.num_rows


def test_store_of_the_wrong_geometry_is_refused(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    path = write_deepseek_checkpoint(tmp_path / "m.safetensors", small, packed)
    store = make_store(TablePlacement("host", device="cpu"), num_rows=10, E=small.head_dim)
    with pytest.raises(ValidationError, match="store holds 10 rows"):
        load_table(path, small, 0, store=store)


# --- validation ------------------------------------------------------------------

Case = namedtuple("Case", "change needle")


def _replace(name_template, value_fn):
    def change(config, tensors):
        name = name_template.format(layer=5)
        tensors[name] = value_fn(config, tensors[name])

    return change


_BAD_CHECKPOINTS = {
    "missing weight": Case(
        lambda config, tensors: tensors.pop(WEIGHT.format(layer=5)),
        r"layer 5: no weight tensor 'layers\.5\.engram\.embed\.weight' or .* in .*m\.safetensors",
    ),
    "weight dtype": Case(
        _replace(WEIGHT, lambda c, t: t.to(torch.bfloat16)),
        r"'layers\.5\.engram\.embed\.weight' in m\.safetensors \(layer 5 weight\) has "
        r"dtype BF16; expected F8_E4M3",
    ),
    "head dim": Case(
        _replace(WEIGHT, lambda c, t: t[:, :64].contiguous()),
        r"has shape \[(\d+), 64\]; expected \[\1, 96\] \(engram_head_dim = 96\)",
    ),
    "too few rows": Case(
        _replace(WEIGHT, lambda c, t: t[:-3].contiguous()),
        r"has shape \[(\d+), 96\]; expected \[(\d+), 96\] \(engram_num_embeddings\[1\]",
    ),
    "scale width": Case(
        _replace(SCALE, lambda c, t: torch.cat([t, t[:, :1]], dim=1)),
        r"weight_scale_inv' in m\.safetensors \(layer 5 scale\) has shape \[(\d+), 4\]; "
        r"expected \[\1, 3\] \(one ue8m0 byte per 32 of E = 96\)",
    ),
    "scale dtype": Case(
        _replace(SCALE, lambda c, t: t.view(torch.uint8).float()),
        r"has dtype F32; expected F8_E8M0 .* or U8",
    ),
    "scale rows": Case(
        _replace(SCALE, lambda c, t: t[1:].contiguous()),
        r"weight_scale_inv' .* has shape \[\d+, 3\]; expected \[\d+, 3\]",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_CHECKPOINTS), ids=list(_BAD_CHECKPOINTS))
def test_bad_tensors_are_named_with_expected_and_found(tmp_path, small, small_tables, case):
    from safetensors.torch import save_file

    _, packed = small_tables
    tensors = _deepseek_tensors(small, packed)
    _BAD_CHECKPOINTS[case].change(small, tensors)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=_BAD_CHECKPOINTS[case].needle) as info:
        load_table(tmp_path / "m.safetensors", small, 1, TablePlacement("host", device="cpu"))
    if case == "too few rows":
        rows = small.num_embeddings[1]
        assert f"[{rows - 3}, 96]; expected [{rows}, 96]" in str(info.value)
    # The good layers still load.
    assert read_table(tmp_path / "m.safetensors", small, 0).shape[0] > 0


def test_missing_checkpoint_and_empty_directory(tmp_path, small) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_table(tmp_path / "nope", small, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no"):
        read_table(tmp_path / "empty", small, 0)


def test_truncated_file_in_a_directory_is_named(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_deepseek_checkpoint(directory / "a.safetensors", small, packed)
    data = (directory / "a.safetensors").read_bytes()
    (directory / "a.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"a\.safetensors: tensor .*truncated"):
        read_table(directory, small, 0)


# --- save_tables: atomicity and refusals ----------------------------------------------


def test_interrupted_save_leaves_no_file_and_keeps_the_old_one(
    tmp_path, small, small_tables, monkeypatch
) -> None:
    _, packed = small_tables
    target = tmp_path / "out" / "engram.safetensors"
    calls = {"n": 0}
    real_append = SafetensorsStreamWriter.append

    def failing_append(self, name, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated interruption")
        real_append(self, name, data)

    monkeypatch.setattr(SafetensorsStreamWriter, "append", failing_append)
    with pytest.raises(KeyboardInterrupt):
        save_tables(target, packed, small, block_rows=20)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no temporary file left behind

    monkeypatch.setattr(SafetensorsStreamWriter, "append", real_append)
    save_tables(target, packed, small)
    before = target.read_bytes()
    calls["n"] = 0
    monkeypatch.setattr(SafetensorsStreamWriter, "append", failing_append)
    with pytest.raises(KeyboardInterrupt):
        save_tables(target, [t.flip(0) for t in packed], small, block_rows=20)
    assert target.read_bytes() == before
    assert [p.name for p in target.parent.iterdir()] == ["engram.safetensors"]


def test_save_tables_checks_free_disk_space(tmp_path, small, small_tables, monkeypatch) -> None:
    _, packed = small_tables
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(CapacityError, match=r"needs \d+ bytes .* only 1000 bytes"):
        save_tables(tmp_path / "x.safetensors", packed, small)
    assert not (tmp_path / "x.safetensors").exists()


def test_save_tables_refuses_tables_that_do_not_fit(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    out = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"layer 5 has \d+ rows; expected \d+ \(the full"):
        save_tables(out, [packed[0], packed[1][:-1], packed[2]], small)
    with pytest.raises(CheckpointError, match=r"rank 1 of tp=2"):
        save_tables(out, packed, small, tp=2, rank=1)
    with pytest.raises(CheckpointError, match=r"2 table\(s\); expected 3"):
        save_tables(out, packed[:2], small)
    with pytest.raises(CheckpointError, match=r"layers \[0, 5\]; expected exactly \[0, 5, 7\]"):
        save_tables(out, {0: packed[0], 5: packed[1]}, small)
    with pytest.raises(CheckpointError, match="expected packed uint8"):
        save_tables(out, [t.float() for t in packed], small)
    with pytest.raises(CheckpointError, match="scale_dtype = 'fp32'"):
        save_tables(out, packed, small, scale_dtype="fp32")
    with pytest.raises(CheckpointError, match="reserved"):
        save_tables(out, packed, small, metadata={"engramrt_tp": "9"})
    assert not out.exists()


def test_a_shard_of_another_layer_is_refused(tmp_path, small, small_tables) -> None:
    _, packed = small_tables
    path = write_deepseek_checkpoint(tmp_path / "m.safetensors", small, packed)
    layout = EngramLayout(small)
    own, other = layout.column_shard(0, 2, 1), layout.column_shard(1, 2, 1)
    assert own != other  # layers hold other rows
    rows = [b for _, b in iter_packed_rows(path, small, 0, shard=own)]
    assert sum(b.shape[0] for b in rows) == own.num_rows
    with pytest.raises(ValidationError, match=r"expected layer \d+'s shard of rank 1 of tp=2"):
        next(iter_packed_rows(path, small, 0, shard=other))


def _failing_open(code: int):
    def fake_open(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[0]))

    return fake_open


@pytest.mark.parametrize(
    ("code", "error", "reason"),
    [
        (errno.EROFS, ValidationError, "Read-only file system"),
        (errno.EACCES, ValidationError, "Permission denied"),
        (errno.ENOSPC, CapacityError, "No space left on device; free some space"),
    ],
)
def test_the_disk_tier_in_an_unwritable_directory_is_one_clean_error(
    tmp_path, tiny, tiny_tables, monkeypatch, code, error, reason
) -> None:
    """load_tables with tier disk, its packed-row files refused by the file system
    (injected: the tests run as root, whom a read-only mode does not stop)."""
    from engramrt.lookup.tiers import host_rows

    _, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "m.safetensors", tiny, packed)
    placement = TablePlacement("disk", device="cpu", disk_dir=tmp_path / "rows")
    monkeypatch.setattr(host_rows, "open", _failing_open(code), raising=False)
    with pytest.raises(error) as info:
        load_tables(path, tiny, placement)
    message = str(info.value)
    first = placement.disk_path(tiny.layer_ids[0])
    assert (
        message.startswith("tier='disk' (")
        and f"file {str(first)!r} cannot be created: " in message
    )
    assert all(part in message for part in reason.split("; "))
    assert "\n" not in message


def test_the_disk_tier_under_a_regular_file_is_one_clean_error(tmp_path, tiny, tiny_tables):
    """A disk_dir that is a file, or lies under one (the real file system, no injection)."""
    _, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "m.safetensors", tiny, packed)
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")
    for disk_dir in (blocker, blocker / "rows"):
        placement = TablePlacement("disk", device="cpu", disk_dir=disk_dir)
        with pytest.raises(ValidationError) as info:
            load_tables(path, tiny, placement)
        message = str(info.value)
        assert (
            f"file {str(placement.disk_path(tiny.layer_ids[0]))!r} cannot be created: " in message
        )
        assert "Not a directory" in message or "File exists" in message
    assert blocker.read_bytes() == b"x"
    # the control: a writable directory serves the checkpoint's bytes
    stores = load_tables(path, tiny, TablePlacement("disk", device="cpu", disk_dir=tmp_path / "ok"))
    layout = EngramLayout(tiny)
    for layer_index, store in enumerate(stores):
        shard = layout.column_shard(layer_index, 1, 0)
        assert torch.equal(store.source, packed[layer_index][shard.row_begin : shard.row_end])
