"""PLE tables into storage tiers, and through ``engramrt convert``'s per-rank files.

The expected rows are the source tables themselves (``random_table``, sliced by hand the
way ``torch.chunk`` splits a row's values), never something the loader computed; every
comparison is of the stored bytes, bit for bit. The refusals each edit a conversion that,
unedited, loads (the control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tests.families.qwen4_ple.ple_checkpoints import (
    COMPOSITE,
    CONFIG,
    FIELDS,
    ROWS,
    TEXT_ONLY,
    checkpoint_state,
    random_table,
    save,
)

from engramrt.checkpoint.conversion_set import KILL_ENV, MANIFEST_NAME
from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple.convert import convert_ple_checkpoint, plan_ple_conversion
from engramrt.families.qwen4_ple.family import Qwen4PleFamily
from engramrt.families.qwen4_ple.loading import load_ple_tables
from engramrt.family import BF16
from engramrt.lookup.tiers import RowStore, TablePlacement

TIERS = ("device", "host", "disk")


def expected_slice(ple_index: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank`` of ``tp``'s values of every row, by ``torch.chunk`` along the values."""
    return torch.chunk(random_table(ple_index, torch.bfloat16), tp, dim=1)[rank]


def stored_rows(store: RowStore) -> torch.Tensor:
    """Every row the store holds, as bf16 values (its bytes reinterpreted, not converted)."""
    return store.gather_packed(torch.arange(store.num_rows)).cpu().view(torch.bfloat16)


def placement(tier: str, tp: int, rank: int, tmp_path: Path) -> TablePlacement:
    return TablePlacement(tier, "cpu", tp=tp, rank=rank, disk_dir=tmp_path / "rows")


def load_all(path: Path, tier: str, tp: int, tmp_path: Path, **options) -> list[list[RowStore]]:
    """``stores[rank][ple_index]`` for every rank of ``tp``."""
    return [
        load_ple_tables(path, CONFIG, placement(tier, tp, rank, tmp_path), **options)
        for rank in range(tp)
    ]


def assert_rank_rows(stores: list[list[RowStore]], tp: int) -> None:
    for rank, rank_stores in enumerate(stores):
        for ple_index, store in enumerate(rank_stores):
            want = expected_slice(ple_index, tp, rank)
            assert store.row_format == BF16 and (store.num_rows, store.E) == tuple(want.shape)
            got = stored_rows(store)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"rank {rank} of tp={tp}, PLE index {ple_index}: "
                f"{int((got != want).sum())} values differ"
            )


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("src"), checkpoint_state(COMPOSITE, parts=7))


@pytest.fixture(scope="module")
def converted_tp2(tmp_path_factory: pytest.TempPathFactory, sharded_source: Path) -> Path:
    dst = tmp_path_factory.mktemp("tp2")
    convert_ple_checkpoint(sharded_source, dst, CONFIG, tp=2, block_rows=37)
    return dst


# --------------------------------------------------------------------------- direct loads


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", ["shards", "whole", "indexed"])
def test_rows_reach_every_tier_bit_for_bit(tmp_path: Path, tier: str, tp: int, layout: str) -> None:
    state = checkpoint_state(TEXT_ONLY, sharded=layout != "whole", parts=7)
    path = save(tmp_path / "src", state, files=3 if layout == "indexed" else 1)
    if layout == "whole":
        path = path / "model.safetensors"  # a file, not a directory
    rows: list[int] = []
    stores = load_all(path, tier, tp, tmp_path, block_rows=50, on_rows=rows.append)
    assert_rank_rows(stores, tp)
    assert sum(rows) == tp * sum(ROWS) and max(rows) <= 50
    if tier == "disk":
        assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == sorted(
            f"ple-layer{layer}-rank{rank}-of-{tp}.rows"
            for layer in CONFIG.ple_layer_ids
            for rank in range(tp)
        )


def test_control_another_ranks_values_differ(sharded_source: Path, tmp_path: Path) -> None:
    """The comparison above can fail: rank 1's store is not rank 0's slice."""
    (store,) = load_ple_tables(
        sharded_source, CONFIG, placement("host", 2, 1, tmp_path), ple_indices=[1]
    )
    assert torch.equal(stored_rows(store), expected_slice(1, 2, 1))
    assert not torch.equal(stored_rows(store), expected_slice(1, 2, 0))


def test_family_value_and_config_paths_load_alike(sharded_source: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": FIELDS})
    )
    where = placement("host", 2, 0, tmp_path)
    for config in (Qwen4PleFamily(CONFIG), FIELDS, tmp_path, tmp_path / "config.json"):
        stores = load_ple_tables(sharded_source, config, where)
        assert [
            torch.equal(stored_rows(s), expected_slice(i, 2, 0)) for i, s in enumerate(stores)
        ] == [True, True]


def test_direct_refusals(tmp_path: Path, sharded_source: Path) -> None:
    fp32 = save(tmp_path / "fp32", checkpoint_state(COMPOSITE, dtype=torch.float32))
    with pytest.raises(CheckpointError, match=r"stored in torch.float32; expected torch.bfloat16"):
        load_ple_tables(fp32, CONFIG, placement("host", 1, 0, tmp_path))
    # d = 4 values a row: tp=3 gives ranks 2, 2 and 0 values.
    with pytest.raises(ValidationError, match=r"tp=3 leaves rank 2 no value .* one of 1, 2, 4$"):
        load_ple_tables(sharded_source, CONFIG, placement("host", 3, 2, tmp_path))
    with pytest.raises(
        ValidationError, match=r"ple_indices=\[2\]; expected distinct ints in \[0, 2\)"
    ):
        load_ple_tables(sharded_source, CONFIG, placement("host", 1, 0, tmp_path), ple_indices=[2])
    assert not (tmp_path / "rows").exists()  # refused before any store was made


# --------------------------------------------------------------------------- conversions


def test_conversion_files_hold_each_ranks_values(converted_tp2: Path) -> None:
    family = Qwen4PleFamily(CONFIG)
    names = sorted(p.name for p in converted_tp2.iterdir())
    assert names == [MANIFEST_NAME, "ple-rank0-of-2.safetensors", "ple-rank1-of-2.safetensors"]
    for rank in range(2):
        with safe_open(str(converted_tp2 / f"ple-rank{rank}-of-2.safetensors"), "pt") as handle:
            metadata = handle.metadata()
            tables = json.loads(metadata["engramrt_ple_tables"])
            assert metadata["engramrt_family"] == "qwen4-ple"
            assert metadata["engramrt_fingerprint"] == family.fingerprint()
            assert (metadata["engramrt_tp"], metadata["engramrt_rank"]) == ("2", str(rank))
            for ple_index, table in enumerate(tables):
                assert (table["layer"], table["value_begin"], table["value_end"]) == (
                    CONFIG.ple_layer_ids[ple_index],
                    2 * rank,
                    2 * rank + 2,
                )
                tensor = handle.get_tensor(table["name"])
                assert table["name"].endswith(".ple.ple_embedding.ngram_embedding.weight")
                assert torch.equal(
                    tensor.view(torch.int16), expected_slice(ple_index, 2, rank).view(torch.int16)
                )


@pytest.mark.parametrize("load_tp", [1, 2, 4])
def test_convert_then_load_equals_direct_load(
    tmp_path: Path, sharded_source: Path, converted_tp2: Path, load_tp: int
) -> None:
    """A conversion of tp=2 serves tp=2 ranks file by file, tp=1 stitched from both files
    and tp=4 from halves of each; every store equals the direct load's, byte for byte."""
    direct = load_all(sharded_source, "host", load_tp, tmp_path / "a")
    converted = load_all(converted_tp2, "disk", load_tp, tmp_path / "b", block_rows=29)
    assert_rank_rows(converted, load_tp)
    for ours, theirs in zip(direct, converted, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(
                a.gather_packed(torch.arange(a.num_rows)), b.gather_packed(torch.arange(b.num_rows))
            )


def test_single_file_conversion_and_reconversion(tmp_path: Path, sharded_source: Path) -> None:
    (one,) = convert_ple_checkpoint(sharded_source, tmp_path / "one.safetensors", CONFIG)
    assert one == tmp_path / "one.safetensors"
    assert_rank_rows(load_all(one, "host", 2, tmp_path), 2)
    paths = convert_ple_checkpoint(one, tmp_path / "four", CONFIG, tp=4)  # a conversion's own
    assert [p.name for p in paths] == [f"ple-rank{r}-of-4.safetensors" for r in range(4)]
    assert_rank_rows(load_all(tmp_path / "four", "device", 4, tmp_path), 4)


def rewrite(path: Path, *, metadata: dict | None = None, edit=None) -> None:
    """Write ``path`` again with its metadata updated by ``metadata`` and its tensors by ``edit``."""
    with safe_open(str(path), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        recorded = dict(handle.metadata())
    if edit is not None:
        edit(tensors, recorded)
    save_file(tensors, str(path), metadata={**recorded, **(metadata or {})})


@pytest.fixture
def copy_of_tp2(tmp_path: Path, converted_tp2: Path) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in converted_tp2.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def test_control_the_unedited_copy_loads(tmp_path: Path, copy_of_tp2: Path) -> None:
    assert_rank_rows(load_all(copy_of_tp2, "host", 2, tmp_path, verify_checksums=True), 2)


def test_a_conversion_for_another_config_is_refused(tmp_path: Path, copy_of_tp2: Path) -> None:
    other = Qwen4PleFamily(CONFIG.replace(seed=CONFIG.seed + 1))
    rank0 = copy_of_tp2 / "ple-rank0-of-2.safetensors"
    rewrite(rank0, metadata={"engramrt_fingerprint": other.fingerprint()})
    with pytest.raises(
        CheckpointError,
        match=rf"ple-rank0-of-2.safetensors records engramrt_fingerprint='{other.fingerprint()}'; the config gives '{Qwen4PleFamily(CONFIG).fingerprint()}'",
    ):
        load_ple_tables(copy_of_tp2, CONFIG, placement("host", 2, 1, tmp_path))
    rewrite(rank0, metadata={"engramrt_family": "deepseek-engram"})
    with pytest.raises(
        CheckpointError, match=r"records engramrt_family='deepseek-engram'; expected 'qwen4-ple'"
    ):
        load_ple_tables(copy_of_tp2, CONFIG, placement("host", 2, 0, tmp_path))


def test_a_missing_rank_is_refused_naming_the_values(tmp_path: Path, converted_tp2: Path) -> None:
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "ple-rank0-of-2.safetensors").write_bytes(
        (converted_tp2 / "ple-rank0-of-2.safetensors").read_bytes()
    )
    assert_rank_rows([load_ple_tables(lone, CONFIG, placement("host", 2, 0, tmp_path))], 2)
    with pytest.raises(
        CheckpointError,
        match=r"no converted file holds value 2 of PLE layer 1's rows: this rank needs values \[2, 4\) and the files hold ple-rank0-of-2.safetensors \(rank 0 of tp=2\): \[0, 2\)",
    ):
        load_ple_tables(lone, CONFIG, placement("host", 2, 1, tmp_path))


def test_a_tensor_that_disagrees_with_its_metadata_is_refused(
    tmp_path: Path, copy_of_tp2: Path
) -> None:
    rank1 = copy_of_tp2 / "ple-rank1-of-2.safetensors"

    def widen(tensors: dict, recorded: dict) -> None:
        tables = json.loads(recorded["engramrt_ple_tables"])
        tables[0]["value_begin"] = 1  # claims values [1, 4) for a [R, 2] tensor
        recorded["engramrt_ple_tables"] = json.dumps(tables)

    rewrite(rank1, edit=widen)
    with pytest.raises(
        CheckpointError,
        match=r"is BF16 \[424, 2\]; expected BF16 \[424, 3\] \(its metadata says it holds values \[1, 4\)",
    ):
        load_ple_tables(copy_of_tp2, CONFIG, placement("host", 2, 1, tmp_path))


def test_changed_bytes_are_refused_by_the_checksum(tmp_path: Path, copy_of_tp2: Path) -> None:
    rank1 = copy_of_tp2 / "ple-rank1-of-2.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-7] ^= 0x01  # one bit of the last table's values: still finite bf16
    rank1.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"ple-rank1-of-2.safetensors: its content checksum is .* but its metadata records",
    ):
        load_ple_tables(
            copy_of_tp2, CONFIG, placement("host", 2, 1, tmp_path), verify_checksums=True
        )


def test_an_interrupted_conversion_leaves_nothing(tmp_path: Path, sharded_source: Path) -> None:
    dst = tmp_path / "dst"
    blocks = []

    def crash(rows: int) -> None:
        blocks.append(rows)
        if len(blocks) == 5:
            raise RuntimeError("simulated crash mid-conversion")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_ple_checkpoint(sharded_source, dst, CONFIG, tp=2, block_rows=100, on_rows=crash)
    assert list(dst.iterdir()) == []  # neither a file nor a temporary one
    with pytest.raises(CheckpointError, match="holds no"):
        load_ple_tables(dst, CONFIG, placement("host", 2, 0, tmp_path))
    # A complete conversion survives a later one that fails, untouched.
    paths = convert_ple_checkpoint(sharded_source, dst, CONFIG, tp=2)
    before = [p.read_bytes() for p in paths]
    blocks.clear()
    with pytest.raises(RuntimeError):
        convert_ple_checkpoint(sharded_source, dst, CONFIG, tp=2, block_rows=100, on_rows=crash)
    assert [p.read_bytes() for p in paths] == before
    assert sorted(dst.iterdir()) == sorted([*paths, dst / MANIFEST_NAME])


def test_a_killed_conversion_leaves_no_file_that_loads(
    tmp_path: Path, sharded_source: Path
) -> None:
    """SIGKILL mid-write (no cleanup runs): only a hidden temporary stays, which no loader
    reads and the next conversion into the directory removes."""
    dst = tmp_path / "dst"
    script = (
        "import sys; from engramrt.families.qwen4_ple.convert import convert_ple_checkpoint; "
        "from tests.families.qwen4_ple.ple_checkpoints import CONFIG; "
        "convert_ple_checkpoint(sys.argv[1], sys.argv[2], CONFIG, tp=2, block_rows=100)"
    )
    root = Path(__file__).resolve().parents[3]
    path = os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, KILL_ENV: "convert:block", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", script, str(sharded_source), str(dst)], env=env, check=False
    )
    assert done.returncode == -9
    assert [p.name for p in dst.iterdir() if not p.name.startswith(".")] == []
    with pytest.raises(CheckpointError, match="holds no"):
        load_ple_tables(dst, CONFIG, placement("host", 2, 0, tmp_path))
    convert_ple_checkpoint(sharded_source, dst, CONFIG, tp=2)
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # the temporary is gone
    assert_rank_rows(load_all(dst, "host", 2, tmp_path), 2)


def test_conversion_refusals(tmp_path: Path, sharded_source: Path) -> None:
    with pytest.raises(ValidationError, match=r"tp=3 leaves rank 2 no value"):
        plan_ple_conversion(sharded_source, tmp_path / "dst", CONFIG, tp=3)
    with pytest.raises(ValidationError, match=r"tp=0; expected a tensor-parallel size"):
        plan_ple_conversion(sharded_source, tmp_path / "dst", CONFIG, tp=0)
    source_file = sharded_source / "model.safetensors"
    with pytest.raises(CheckpointError, match=r"is a source file"):
        plan_ple_conversion(source_file, source_file, CONFIG)
    assert not (tmp_path / "dst").exists()
