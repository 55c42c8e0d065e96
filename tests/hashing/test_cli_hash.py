from __future__ import annotations

import json

import numpy as np
import pytest

from engramrt.cli import main


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.mark.parametrize("history", ["lookback", "slot", "request"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_hash_chunks_match_one_shot_and_save(capsys, tmp_path, history, backend, device) -> None:
    out_file = tmp_path / "ids.npy"
    code, out, _ = _run(
        capsys,
        "hash",
        "--config",
        "tiny",
        "--text",
        "The cat sat on the mat, THE CAT!",
        "--chunks",
        "3,1,2,1",
        "--history",
        history,
        "--backend",
        backend,
        "--out",
        str(out_file),
        "--json",
        "--device",
        str(device) if backend == "triton" else "cpu",
    )
    assert code == 0
    report = json.loads(out)
    assert report["matches_one_shot"] is True
    saved = np.load(out_file)
    assert saved.dtype == np.int64 and saved.shape == (len(report["token_ids"]), 2, 12)
    assert saved.tolist() == report["row_ids"]


def test_hash_ids_file_and_human_output(capsys, tmp_path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([5, 6, 7, 8, 9], dtype=np.int32))
    code, out, _ = _run(
        capsys, "hash", "--config", "tiny", "--ids-file", str(ids), "--chunks", "1,1"
    )
    assert code == 0 and "matches one-shot hashing" in " ".join(out.split())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ids", "1,2,x"], "--ids='1,2,x'"),
        (["--ids", "1,2", "--chunks", "5"], "add up to 5"),
        (["--ids", "1,2", "--chunks", "0,1"], "must all be positive"),
        (["--ids", "1,129280"], "129280"),
        (["--ids", "1", "--text", "a"], "exactly one of"),
        (["--ids", "1", "--history", "magic"], "history='magic'"),
        (["--ids-file", "/nonexistent.npy"], "--ids-file='/nonexistent.npy' cannot be read"),
    ],
)
def test_hash_bad_input(capsys, args, needle) -> None:
    code, _, err = _run(capsys, "hash", "--config", "tiny", *args)
    assert code == 2 and needle in err and "Traceback" not in err
