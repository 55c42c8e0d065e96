"""``engramrt convert`` end to end: exit codes, outputs, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tests.checkpoint.conftest import SCALE, WEIGHT, float_tables, reference_packed

from engramrt.checkpoint import read_header, read_table
from engramrt.cli import main
from engramrt.layout import EngramLayout


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.fixture
def tiny_source(tmp_path, tiny, tiny_tables):
    tables, packed = tiny_tables
    path = tmp_path / "src.safetensors"
    save_file(
        {f"engram.{layer}.weight": t for layer, t in zip(tiny.layer_ids, tables, strict=True)},
        str(path),
    )
    return path, packed


def test_convert_tiny(capsys, tmp_path, tiny, tiny_source) -> None:
    src, packed = tiny_source
    code, out, err = _run(capsys, "convert", src, tmp_path / "out.safetensors", "--config", "tiny")
    assert code == 0, err
    assert "wrote 1 file(s)" in out and "out.safetensors" in out
    for layer_index, want in enumerate(packed):
        layout_rows = EngramLayout(tiny).column_shard(layer_index, 1, 0).row_end
        assert torch.equal(
            read_table(tmp_path / "out.safetensors", tiny, layer_index), want[:layout_rows]
        )


def test_convert_tp_scales_names_block_rows(capsys, tmp_path, tiny, tiny_tables) -> None:
    tables, packed = tiny_tables
    src = tmp_path / "src.safetensors"
    save_file({f"emb{i}": t for i, t in enumerate(tables)}, str(src))
    names = tmp_path / "names.json"
    names.write_text(
        json.dumps({"source": "emb{index}", "weight": "L{layer}.w", "scale": "L{layer}.s"})
    )
    code, out, err = _run(
        capsys,
        "convert",
        src,
        tmp_path / "dst",
        "-c",
        "tiny",
        "--tp",
        "2",
        "--scales",
        "e8m0",
        "--names",
        names,
        "--block-rows",
        "999",
        "--quiet",
    )
    assert code == 0, err
    assert out == ""
    layout = EngramLayout(tiny)
    for rank in range(2):
        path = tmp_path / "dst" / f"engram-rank{rank}-of-2.safetensors"
        assert read_header(path).tensors["L3.s"].dtype == "F8_E8M0"
        shard = layout.column_shard(1, 2, rank)
        got = read_table(path, tiny, 1, tp=2, rank=rank, names=str(names))
        assert torch.equal(got, packed[1][shard.row_begin : shard.row_end])


def test_config_comes_from_the_source_directory(capsys, tmp_path, small) -> None:
    tables = float_tables(small, seed=21, dtype=torch.bfloat16)
    model = tmp_path / "model"
    model.mkdir()
    save_file(
        {f"engram.{layer}.weight": t for layer, t in zip(small.layer_ids, tables, strict=True)},
        str(model / "model.safetensors"),
    )
    (model / "config.json").write_text(json.dumps(small.to_hf_dict()))
    code, _, err = _run(capsys, "convert", model, tmp_path / "out")
    assert code == 0, err
    path = tmp_path / "out" / "engram.safetensors"
    assert set(read_header(path).tensors) == {
        name.format(layer=layer) for layer in small.layer_ids for name in (WEIGHT, SCALE)
    }
    for layer_index, want in enumerate(reference_packed(tables)):
        assert torch.equal(read_table(path, small, layer_index), want)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["MISSING", "DST", "-c", "tiny"], "SRC"),
        (["SRC", "DST", "-c", "tiny", "--scales", "f32"], "scale_dtype = 'f32'"),
        (["SRC", "DST", "-c", "tiny", "--tp", "7"], "tp=7"),
        (["SRC", "DST", "-c", "tiny", "--block-rows", "0"], "--block-rows=0"),
        (["SRC", "DST", "-c", "tiny", "--names", "NAMES"], "names file"),
        (["SRC", "DST", "-c", "nope"], "neither a preset"),
        (["SRC", "DST"], "has shape [49796, 64]; expected [384006168, 256]"),
        (["SRC", "DST", "-c", "tiny", "--names", "BADNAMES"], "no source tensor 'nothing.1'"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, tmp_path, tiny_source, args, needle) -> None:
    src, _ = tiny_source
    (tmp_path / "bad_names.json").write_text(json.dumps({"source": "nothing.{layer}"}))
    table = {
        "SRC": str(src),
        "MISSING": str(tmp_path / "missing.safetensors"),
        "DST": str(tmp_path / "dst"),
        "NAMES": str(tmp_path / "no_names.json"),
        "BADNAMES": str(tmp_path / "bad_names.json"),
    }
    code, _out, err = _run(capsys, "convert", *[table.get(a, a) for a in args])
    assert code == 2
    assert needle in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not (tmp_path / "dst").exists() or list((tmp_path / "dst").iterdir()) == []


def test_disk_full_is_a_one_line_error(capsys, tmp_path, tiny_source, monkeypatch) -> None:
    src, _ = tiny_source
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=12345))
    code, _out, err = _run(capsys, "convert", src, tmp_path / "dst", "-c", "tiny")
    assert code == 2
    assert "only 12345 bytes" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "dst" / "engram.safetensors").exists()


def test_help_lists_the_options(capsys) -> None:
    code, out, _ = _run(capsys, "convert", "--help")
    assert code == 0
    for option in ("--config", "--tp", "--names", "--block-rows", "--scales"):
        assert option in out
