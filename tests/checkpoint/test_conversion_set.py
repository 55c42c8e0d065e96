"""One conversion, one set: conversion ids, the commit manifest, stale and mixed files, crashes.

The crash tests SIGKILL a real ``engramrt convert`` process (a subprocess)
at named points of the commit (``ENGRAMRT_TEST_KILL_AT``) and check that
loading afterwards gives the old complete set before the commit point and
the new one after it, never a mix, and that the next conversion cleans up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engramrt.checkpoint import convert_checkpoint, read_header, read_table
from engramrt.checkpoint.conversion_set import KILL_ENV, MANIFEST_NAME, META_CONVERSION_ID
from engramrt.errors import CheckpointError
from engramrt.layout import EngramLayout

from .conftest import float_tables, reference_packed

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "engram.{layer}.weight"


def _source(path: Path, config, seed: int) -> tuple[Path, list[torch.Tensor]]:
    tables = float_tables(config, seed=seed)
    save_file(
        {SOURCE.format(layer=layer): t for layer, t in zip(config.layer_ids, tables, strict=True)},
        str(path),
    )
    return path, reference_packed(tables)


def _rank_rows(config, packed, tp: int, rank: int) -> list[torch.Tensor]:
    layout = EngramLayout(config)
    rows = []
    for index, table in enumerate(packed):
        shard = layout.column_shard(index, tp, rank)
        rows.append(table[shard.row_begin : shard.row_end])
    return rows


def _loaded(dst: Path, config, tp: int) -> list[list[torch.Tensor]]:
    return [
        [read_table(dst, config, index, tp=tp, rank=rank) for index in range(config.n_layers)]
        for rank in range(tp)
    ]


def _equals(loaded, config, packed, tp: int) -> bool:
    return all(
        all(
            torch.equal(got, want)
            for got, want in zip(ranks, _rank_rows(config, packed, tp, rank), strict=True)
        )
        for rank, ranks in enumerate(loaded)
    )


def _ids(paths) -> set[str]:
    return {read_header(p).metadata[META_CONVERSION_ID] for p in paths}


def test_files_of_one_conversion_share_its_id(tmp_path, small) -> None:
    src, packed = _source(tmp_path / "a.safetensors", small, 1)
    paths = convert_checkpoint(src, tmp_path / "dst", small, tp=2)
    (conversion_id,) = _ids(paths)
    manifest = json.loads((tmp_path / "dst" / MANIFEST_NAME).read_text())
    assert manifest["conversion_id"] == conversion_id and len(conversion_id) == 32
    assert manifest["files"] == [p.name for p in paths]
    again = convert_checkpoint(src, tmp_path / "dst", small, tp=2)
    assert _ids(again) != {conversion_id}
    assert _equals(_loaded(tmp_path / "dst", small, 2), small, packed, 2)


def test_single_file_then_tp2_leaves_no_stale_file(tmp_path, small) -> None:
    """convert A -> D, then B -> D --tp 2: every rank loads B (A's single file once won rank 0)."""
    src_a, packed_a = _source(tmp_path / "a.safetensors", small, 1)
    src_b, packed_b = _source(tmp_path / "b.safetensors", small, 2)
    dst = tmp_path / "dst"
    (single,) = convert_checkpoint(src_a, dst, small)
    kept = tmp_path / "a-copy.safetensors"
    shutil.copy(single, kept)
    convert_checkpoint(src_b, dst, small, tp=2)
    assert not single.exists()
    assert _equals(_loaded(dst, small, 2), small, packed_b, 2)
    assert not _equals(_loaded(dst, small, 2), small, packed_a, 2)  # the check can fail
    # The stale file put back beside the set is refused, naming both ids.
    shutil.copy(kept, single)
    (a_id,) = _ids([single])
    (b_id,) = _ids([dst / "engram-rank0-of-2.safetensors"])
    with pytest.raises(
        CheckpointError, match=rf"engram\.safetensors \(conversion id {a_id}\).*{b_id}"
    ):
        read_table(dst, small, 0, tp=2, rank=0)


def test_mixed_ids_are_refused(tmp_path, small) -> None:
    src_a, _ = _source(tmp_path / "a.safetensors", small, 1)
    src_b, _ = _source(tmp_path / "b.safetensors", small, 2)
    convert_checkpoint(src_a, tmp_path / "one", small, tp=2)
    convert_checkpoint(src_b, tmp_path / "two", small, tp=2)
    rank1 = "engram-rank1-of-2.safetensors"
    (other_id,) = _ids([tmp_path / "two" / rank1])
    shutil.copy(tmp_path / "two" / rank1, tmp_path / "one" / rank1)
    with pytest.raises(
        CheckpointError, match=rf"{rank1} is conversion id {other_id} but .* names conversion"
    ):
        read_table(tmp_path / "one", small, 0, tp=2, rank=0)
    # Without a manifest, files of two conversions are refused too.
    (tmp_path / "one" / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"files of different conversions: .*rank0.*rank1"):
        read_table(tmp_path / "one", small, 0, tp=2, rank=0)


def test_same_tensor_in_two_source_files_is_an_error(tmp_path, small) -> None:
    src = tmp_path / "src"
    src.mkdir()
    tables = float_tables(small, seed=1)
    names = {
        SOURCE.format(layer=layer): t for layer, t in zip(small.layer_ids, tables, strict=True)
    }
    save_file(names, str(src / "part-a.safetensors"))
    first = SOURCE.format(layer=small.layer_ids[0])
    save_file({first: tables[0] * 2}, str(src / "part-b.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'{first}' is in two files.*part-a.*part-b"):
        convert_checkpoint(src, tmp_path / "dst", small)
    assert not (tmp_path / "dst").exists()


def _convert_process(src: Path, dst: Path, config_file: Path, kill_at: str | None) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop(KILL_ENV, None)
    if kill_at is not None:
        env[KILL_ENV] = kill_at
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engramrt.cli",
            "convert",
            str(src),
            str(dst),
            "-c",
            str(config_file),
            "--tp",
            "2",
            "--block-rows",
            "40",
            "-q",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode


# (kill point, whose set loads afterwards)
KILL_POINTS = [
    ("convert:block", "old"),
    ("convert:finished-1", "old"),
    ("convert:staged", "old"),
    ("convert:manifest", "new"),
    ("convert:renamed-1", "new"),
    ("convert:renamed-2", "new"),
    ("convert:cleaned", "new"),
]


@pytest.mark.parametrize(("kill_at", "survivor"), KILL_POINTS)
def test_sigkill_during_convert_leaves_old_or_new_set(tmp_path, small, kill_at, survivor) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(small.to_hf_dict()))
    src_a, packed_a = _source(tmp_path / "a.safetensors", small, 1)
    src_b, packed_b = _source(tmp_path / "b.safetensors", small, 2)
    dst = tmp_path / "dst"
    convert_checkpoint(src_a, dst, small)  # an old single file, which the tp=2 set replaces
    convert_checkpoint(src_a, dst, small, tp=2)
    assert _convert_process(src_b, dst, config_file, kill_at) == -signal.SIGKILL
    want = packed_a if survivor == "old" else packed_b
    other = packed_b if survivor == "old" else packed_a
    loaded = _loaded(dst, small, 2)
    assert _equals(loaded, small, want, 2)
    assert not _equals(loaded, small, other, 2)
    # The next conversion completes and removes every temporary of the killed one. It runs in
    # this process (the same code as `engramrt convert`, one torch import fewer per kill
    # point); test_a_conversion_process_completes runs the command itself to the end.
    convert_checkpoint(src_b, dst, small, tp=2, block_rows=40)
    assert _equals(_loaded(dst, small, 2), small, packed_b, 2)
    assert sorted(p.name for p in dst.iterdir()) == [
        "engram-rank0-of-2.safetensors",
        "engram-rank1-of-2.safetensors",
        MANIFEST_NAME,
    ]


def test_a_conversion_process_completes(tmp_path, small) -> None:
    """The command the kill tests start, not killed: exit 0 and the new set loads."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(small.to_hf_dict()))
    src, packed = _source(tmp_path / "a.safetensors", small, 1)
    assert _convert_process(src, tmp_path / "dst", config_file, None) == 0
    assert _equals(_loaded(tmp_path / "dst", small, 2), small, packed, 2)


def test_sigterm_removes_the_conversions_temporaries(tmp_path, small) -> None:
    """SIGTERM mid-write (a scheduler stopping the job): exit without a staged file left."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(small.to_hf_dict()))
    src, _packed = _source(tmp_path / "a.safetensors", small, 1)
    dst = tmp_path / "dst"
    code = _convert_process(src, dst, config_file, "convert:block:TERM")
    assert code == 128 + signal.SIGTERM
    assert list(dst.iterdir()) == []
    # The control: the same point with SIGKILL leaves the staged files (for the next run).
    assert _convert_process(src, dst, config_file, "convert:block") == -signal.SIGKILL
    assert sorted(p.name.endswith(".tmp") for p in dst.iterdir()) == [True, True]
