"""No command exits 0 having done nothing it was asked to: each case below once printed a line
(or an empty table) and exited 0, or named the wrong cause; each now exits 2 with one line
naming the path or pattern and what was expected. A control beside each shows the same
command succeeding on input that has what it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tests.checkpoint.test_conversion_set import _source

from engramrt.checkpoint import convert_checkpoint
from engramrt.checkpoint.safetensors_format import META_DATA_SHA256
from engramrt.cli import main


def _run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, " ".join(err.split())


def _refused(code: int, err: str, *needles: str) -> None:
    assert code == 2 and err.startswith("error:") and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in err, (needle, err)


def _drop_checksum(path: Path) -> None:
    """Rewrite ``path`` with the same tensors and metadata less its content checksum."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    del metadata[META_DATA_SHA256]
    save_file(tensors, str(path), metadata=metadata)


# -- inspect --checkpoint: asked to verify, nothing (or not everything) verifiable ---------


def test_inspect_checkpoint_without_any_checksum_is_refused(capsys, tmp_path, tiny) -> None:
    src, _ = _source(tmp_path / "float.safetensors", tiny, 1)  # float tables: no checksum
    code, out, err = _run(capsys, "inspect", "-c", "tiny", "--checkpoint", src)
    _refused(code, err, f"--checkpoint '{src}'", "1 of 1 file(s) record no content checksum")
    assert "nothing could be verified" in err and META_DATA_SHA256 in err and out == ""


def test_inspect_checkpoint_with_one_file_unverifiable_is_refused(capsys, tmp_path, tiny) -> None:
    src, _ = _source(tmp_path / "float.safetensors", tiny, 1)
    paths = convert_checkpoint(src, tmp_path / "dst", tiny, tp=2)
    # Control: every file records its checksum, and each is verified.
    code, out, _ = _run(capsys, "inspect", "-c", "tiny", "--checkpoint", tmp_path / "dst", "--json")
    assert code == 0 and [f["checked"] for f in json.loads(out)["checkpoint_files"]] == [True] * 2
    _drop_checksum(paths[1])
    code, out, err = _run(capsys, "inspect", "-c", "tiny", "--checkpoint", tmp_path / "dst")
    _refused(code, err, "1 of 2 file(s) record no content checksum", paths[1].name)
    assert "not every file could be verified" in err and paths[0].name not in err


# -- inspect PATH: nothing of Engram's to inspect ----------------------------------------


def test_inspect_path_without_engram_tensors_is_refused(capsys, tmp_path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"model.layers.0.mlp.weight": torch.randn(4, 4)}, str(path))
    code, out, err = _run(capsys, "inspect", path)
    _refused(code, err, f"PATH='{path}'", "1 tensor(s)", "holds no memory tensor")
    assert out == ""
    # Control: an Engram tensor beside it is reported.
    save_file(
        {
            "model.layers.0.mlp.weight": torch.randn(4, 4),
            "layers.1.engram.wkv.weight": torch.ones(2),
        },
        str(path),
    )
    code, out, _ = _run(capsys, "inspect", path, "--json")
    assert code == 0 and json.loads(out)["engram_layers"] == [1]


def test_inspect_path_of_a_directory_without_safetensors_is_refused(capsys, tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("no tensors here")
    code, _, err = _run(capsys, "inspect", tmp_path)
    _refused(code, err, f"PATH='{tmp_path}'", "holds no .safetensors file")


# -- convert: nothing to convert -----------------------------------------------------------


def test_convert_with_nothing_to_convert_is_refused(capsys, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = _run(capsys, "convert", tmp_path / "empty", tmp_path / "out", "-c", "tiny")
    _refused(code, err, "holds no *.safetensors file")
    other = tmp_path / "other.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(4, 4)}, str(other))
    code, _, err = _run(capsys, "convert", other, tmp_path / "out", "-c", "tiny")
    _refused(code, err, "no source tensor 'layers.1.engram.embed.weight'")
    assert not (tmp_path / "out").exists()


# -- bench: a pattern or an option that selects nothing ------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--case", "nomatch*"], "case patterns ['nomatch*'] match no benchmark case"),
        (["-k", "hash/*", "-k", "nomatch"], "case patterns ['nomatch'] match no benchmark case"),
        (["-g", "hash", "-k", "lookup/*"], "['lookup/*'] match no benchmark case of group(s) hash"),
    ],
)
def test_bench_names_a_pattern_that_selects_nothing(capsys, args, needle) -> None:
    """Named before the device check, on every machine (was, without a GPU: 'all 30 selected
    benchmark cases time CUDA kernels'; with one, a pattern beside others was dropped)."""
    code, _, err = _run(capsys, "bench", *args, "--device", "cpu")
    _refused(code, err, needle)
    assert "selected benchmark cases time CUDA kernels" not in err


def test_bench_write_config_without_a_tuning_case_is_refused(capsys, tmp_path) -> None:
    code, _, err = _run(capsys, "bench", "-g", "cache", "--write-config", tmp_path / "tuned")
    _refused(code, err, "none of the 2 selected benchmark cases tunes a kernel", "gate, hash")
    assert not (tmp_path / "tuned").exists()
    # Control: a tuning group passes this check and stops at the next (no GPU here), or runs.
    if not torch.cuda.is_available():
        code, _, err = _run(capsys, "bench", "-g", "hash", "--write-config", tmp_path / "tuned")
        _refused(code, err, "selected benchmark cases time CUDA kernels")
