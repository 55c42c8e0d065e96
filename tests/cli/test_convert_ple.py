"""``engramrt convert`` of a Qwen4-Exp checkpoint: the family comes from the config, the
outputs are each rank's bf16 values of the PLE tables, the fp8 options are refused."""

from __future__ import annotations

import json

import pytest
import torch
from tests.families.qwen4_ple.ple_checkpoints import (
    COMPOSITE,
    CONFIG,
    FIELDS,
    checkpoint_state,
    random_table,
    save,
)

from engramrt.cli import main
from engramrt.families.qwen4_ple.loading import load_ple_tables
from engramrt.lookup.tiers import TablePlacement


def _run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.fixture
def model(tmp_path):
    path = save(tmp_path / "model", checkpoint_state(COMPOSITE))
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": FIELDS})
    )
    return path


def test_convert_a_qwen4_exp_model_directory(capsys, tmp_path, model) -> None:
    code, out, err = _run(
        capsys, "convert", model, tmp_path / "dst", "--tp", "2", "--block-rows", "99"
    )
    assert code == 0, err
    assert "wrote 2 file(s)" in out and "PLE layers [1, 3]" in out
    for rank in range(2):
        assert (tmp_path / "dst" / f"ple-rank{rank}-of-2.safetensors").is_file()
        stores = load_ple_tables(
            tmp_path / "dst", CONFIG, TablePlacement("host", "cpu", tp=2, rank=rank)
        )
        for index, store in enumerate(stores):
            want = torch.chunk(random_table(index, torch.bfloat16), 2, dim=1)[rank]
            got = store.gather_packed(torch.arange(store.num_rows)).view(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scales", "e8m0"], "--scales=e8m0 given with --config="),
        (["--device", "cpu", "--names", "N.json"], "--names=N.json, --device=cpu given"),
        (["--tp", "3"], "tp=3 leaves rank 2 no value"),
    ],
)
def test_fp8_options_and_bad_tp_are_one_line_errors(capsys, tmp_path, model, args, needle) -> None:
    code, _out, err = _run(
        capsys, "convert", model, tmp_path / "dst", "-c", model / "config.json", *args
    )
    assert code == 2
    assert needle in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not (tmp_path / "dst").exists()
