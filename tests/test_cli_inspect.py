from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engramrt.cli import main


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_inspect_json_reproduces_v41_flash(capsys, token_map) -> None:
    code, out, _ = _run(capsys, "inspect", "--config", "dsv41-flash", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["num_embeddings"] == [384_006_168, 384_016_682]
    assert report["compressed_vocab_size"] == 99_092
    assert report["pad_id"] == int(token_map.map[2])
    assert len(report["primes"]) == 2 and len(report["primes"][0]) == 3
    assert len(report["primes"][0][0]) == 8
    assert len(report["offsets"][1]) == 24 and report["offsets"][1][0] == 0
    assert len(report["multipliers"][0]) == 4
    assert report["table_bytes"] == [384_006_168 * 264, 384_016_682 * 264]


def test_inspect_memory_plan_follows_head_sharding(capsys) -> None:
    code, out, _ = _run(capsys, "inspect", "--config", "dsv41-flash", "--tp", "4", "--json")
    assert code == 0
    report = json.loads(out)
    plan = {p["placement"]: p for p in report["memory_plan"]}
    per_rank = [sum(rows) * 264 for rows in report["rank_rows"]]
    assert sum(sum(r) for r in report["rank_rows"]) == 384_006_168 + 384_016_682
    assert plan["gpu"]["gpu_bytes_per_rank"] == max(per_rank)
    assert plan["host"]["host_bytes_per_node"] == sum(per_rank)
    assert plan["disk"]["disk_bytes_per_node"] == sum(per_rank)


def test_inspect_human_output(capsys) -> None:
    code, out, _ = _run(capsys, "inspect", "--config", "tiny", "--tp", "2")
    assert code == 0
    assert "memory plan at tp=2" in out and "multipliers" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--config", "nope"], "neither a preset"),
        (["--tp", "7"], "tp=7"),
        (["--tp", "0"], "tp=0"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "does not exist"),
    ],
)
def test_inspect_bad_input_is_one_line_error(capsys, args: list[str], needle: str) -> None:
    code, _out, err = _run(capsys, "inspect", *args)
    assert code == 2
    assert needle in err and err.strip().count("\n") == 0 and "Traceback" not in err


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engramrt.cli", "inspect", "--config", "tiny", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_cols"] == 12


def test_inspect_prints_the_token_map_fingerprint(capsys, token_map) -> None:
    import hashlib

    import numpy as np

    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants, hash_sequence
    from engramrt.tokenmap import default_tokenizer_path, load_tokenizer

    code, out, _ = _run(capsys, "inspect", "--config", "tiny", "--json")
    assert code == 0
    report = json.loads(out)
    fingerprint = report["token_map_fingerprint"]
    tokenizer_file = default_tokenizer_path().read_bytes()
    assert fingerprint["tokenizer_sha256"] == hashlib.sha256(tokenizer_file).hexdigest()
    assert (
        fingerprint["map_sha256"]
        == hashlib.sha256(token_map.map.astype("<i8").tobytes()).hexdigest()
    )
    assert (fingerprint["vocab_size"], fingerprint["compressed_vocab_size"]) == (129_280, 99_092)
    ids = load_tokenizer().encode(fingerprint["probe_text"], add_special_tokens=False).ids
    assert fingerprint["probe_token_ids"] == ids
    cfg = PRESETS["tiny"]
    expected = hash_sequence(token_map.map[ids], HashConstants.from_config(cfg, token_map))
    assert fingerprint["probe_row_ids"] == expected.tolist()
    digest = hashlib.sha256(np.array(fingerprint["probe_row_ids"], dtype="<i8").tobytes())
    assert report["probe_row_ids_sha256"] == digest.hexdigest()

    code, out, _ = _run(capsys, "inspect", "--config", "tiny")
    assert code == 0
    assert f"map sha256 {fingerprint['map_sha256']}" in out
    assert f"row ids sha256 {report['probe_row_ids_sha256']}" in out
