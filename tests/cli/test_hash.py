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
    # Independent of the CLI's own verdict: tokenize and hash the whole text at once here.
    assert _independent_row_ids("The cat sat on the mat, THE CAT!") == report["row_ids"]


def _independent_row_ids(text: str) -> list:
    """Row ids of ``text`` hashed in one shot by the reference, from the tokenizer up."""
    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants, hash_sequence
    from engramrt.tokenmap import TokenMap, load_tokenizer

    token_map = TokenMap.from_tokenizer_file()
    ids = np.array(load_tokenizer().encode(text, add_special_tokens=False).ids, dtype=np.int64)
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    return hash_sequence(token_map.map[ids], consts).tolist()


def test_control_a_wrong_stream_fails_the_independent_check(capsys, monkeypatch) -> None:
    """If streaming lost a token's history, the check above would see it (the CLI's flag too)."""
    from engramrt.hashing import stream as stream_module

    real = stream_module.stream_sequence

    def off_by_one(*args, **kwargs):
        row_ids = real(*args, **kwargs)
        row_ids[-1, 0, 0] += 1
        return row_ids

    monkeypatch.setattr(stream_module, "stream_sequence", off_by_one)
    text = "The cat sat on the mat, THE CAT!"
    code, out, _ = _run(capsys, "hash", "--config", "tiny", "--text", text, "--json")
    report = json.loads(out)
    assert _independent_row_ids(text) != report["row_ids"]
    assert code == 1 and report["matches_one_shot"] is False


def test_hash_ids_file_and_human_output(capsys, tmp_path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([5, 6, 7, 8, 9], dtype=np.int32))
    code, out, _ = _run(
        capsys, "hash", "--config", "tiny", "--ids-file", str(ids), "--chunks", "1,1"
    )
    assert code == 0 and "matches one-shot hashing" in " ".join(out.split())
    # Independent of that verdict: the same file through --json against one-shot hashing here.
    code, out, _ = _run(
        capsys, "hash", "--config", "tiny", "--ids-file", str(ids), "--chunks", "1,1", "--json"
    )
    assert code == 0 and json.loads(out)["row_ids"] == _independent_ids_row_ids([5, 6, 7, 8, 9])


def _independent_ids_row_ids(ids: list[int]) -> list:
    """Row ids of token ids ``ids`` hashed in one shot by the reference."""
    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants, hash_sequence
    from engramrt.tokenmap import TokenMap

    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    return hash_sequence(token_map.map[np.array(ids)], consts).tolist()


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
