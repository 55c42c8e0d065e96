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


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _spec_primes(layers: int, orders: int, heads: int, vocab: int) -> list[list[int]]:
    """SPEC §3's primes by trial division: per (layer, order), from ``vocab - 1`` up, the
    smallest prime not used before, one per head; a layer's list in column order."""
    used: set[int] = set()
    primes: list[list[int]] = []
    for _ in range(layers):
        layer: list[int] = []
        for _ in range(orders):
            cur = vocab - 1
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                layer.append(cur)
        primes.append(layer)
    return primes


def test_inspect_human_output(capsys, token_map) -> None:
    """The printed tables hold the SPEC's layout for the tiny config, recomputed here
    (primes by trial division, offsets as running sums, multipliers from numpy's
    generator), and the memory plan's host bytes from the rows."""
    import re

    import numpy as np

    code, out, _ = _run(capsys, "inspect", "--config", "tiny", "--tp", "2")
    assert code == 0
    # tiny: layers (1, 3), N=4 (orders 2..4), H=4, vocab 4096 per order, seed 0, E=64
    rows = re.findall(r"│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│", out)
    printed = [tuple(int(v.replace(",", "")) for v in row) for row in rows]
    assert len(printed) == 2 * 12
    primes = _spec_primes(2, 3, 4, 4096)
    for layer in range(2):
        offset = 0
        for col in range(12):
            want = (col, 2 + col // 4, col % 4, primes[layer][col], offset)
            assert printed[layer * 12 + col] == want, (layer, col)
            offset += primes[layer][col]
        assert f"{offset:,} rows needed" in out
    bound = max(1, (2**63 - 1) // token_map.num_compressed // 2)
    multipliers = re.findall(r"multipliers \(shift 0\.\.3\):\s*((?:\d+,\s*){3}\d+)", out)
    for layer_id, line in zip((1, 3), multipliers, strict=True):
        rng = np.random.default_rng(10007 * layer_id + 0)
        want_m = rng.integers(0, bound, size=4, dtype=np.int64) * 2 + 1
        assert [int(m.strip()) for m in line.split(",")] == want_m.tolist()
    # Memory plan: every row of both layers once per node, 66 B each (64 fp8 + 2 scales).
    assert "memory plan at tp=2" in out
    host_row = re.search(r"│ host\s*│[^│]*│[^│]*│\s*([\d.]+) GiB │", out)
    assert host_row is not None
    assert host_row.group(1) == f"{(49_796 + 50_980) * 66 / 2**30:.2f}"


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


def test_inspect_names_the_image_placeholder(capsys, token_map) -> None:
    # Id 129264 is what every image position carries (vLLM's <｜deepseek_image｜>).
    import json as json_module

    from engramrt.tokenmap import default_tokenizer_path

    code, out, _ = _run(capsys, "inspect", "--config", "tiny", "--json")
    assert code == 0
    image = json_module.loads(out)["image_placeholder"]
    vocab = json_module.loads(default_tokenizer_path().read_text())
    added = {t["id"]: t["content"] for t in vocab["added_tokens"]}
    assert image == {
        "id": 129264,
        "token": added[129264],
        "compressed_id": int(token_map.map[129264]),
    }
    code, out, _ = _run(capsys, "inspect", "--config", "tiny")
    assert f"image placeholder id 129264: {added[129264]!r} -> compressed" in out


# -- inspect PATH: a checkpoint's headers ---------------------------------------


def _inspect_json(capsys, *args: str) -> dict:
    import json

    from engramrt.cli import main

    with pytest.raises(SystemExit) as info:
        main(["inspect", *args, "--json"])
    assert info.value.code in (0, None)
    return json.loads(capsys.readouterr().out)


def test_inspect_path_reads_a_sharded_checkpoint(capsys, tmp_path) -> None:
    """Names by Engram layer, dtypes, shapes and bytes, against the tensors written here."""
    import json

    import torch
    from safetensors.torch import save_file

    written = {
        "model.layers.1.engram.embedding.weight": torch.zeros(300, 32, dtype=torch.float8_e4m3fn),
        "model.layers.1.engram.wkv.weight": torch.zeros(64, 96, dtype=torch.bfloat16),
        "model.layers.2.self_attn.q_proj.weight": torch.zeros(8, 8),
        "model.layers.3.engram.embedding.scale": torch.zeros(300, 1, dtype=torch.uint8),
    }
    shards = {"a.safetensors": list(written)[:2], "b.safetensors": list(written)[2:]}
    for file, names in shards.items():
        save_file({n: written[n] for n in names}, str(tmp_path / file))
    index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    report = _inspect_json(capsys, str(tmp_path))
    assert report["kind"] == "sharded checkpoint" and report["files"] == list(shards)
    assert report["engram_layers"] == [1, 3]
    found = {t["name"]: t for t in report["engram_tensors"]}
    engram = {n: t for n, t in written.items() if ".engram." in n}
    assert set(found) == set(engram)
    for name, tensor in engram.items():
        assert found[name]["shape"] == list(tensor.shape)
        assert found[name]["bytes"] == tensor.numel() * tensor.element_size()
    assert report["engram_bytes"] == sum(t.numel() * t.element_size() for t in engram.values())
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in written.values())
    assert set(report["token_map"]["files"].values()) == {"no fingerprint recorded"}
    assert report["tiers_that_fit"]["host"]["fits"] is True


def test_inspect_path_checks_a_converted_directory_against_the_tokenizer(capsys) -> None:
    from engramrt_lab.models.packaged import packaged_model_dir

    report = _inspect_json(capsys, str(packaged_model_dir()))
    assert report["kind"] == "converted engramrt directory"
    assert report["token_map"]["files"]["engram.safetensors"] == "matches the tokenizer in use"
    single = _inspect_json(capsys, str(packaged_model_dir() / "engram.safetensors"))
    layers = json.loads((packaged_model_dir() / "config.json").read_text())["engram_layer_ids"]
    assert single["kind"] == "safetensors file" and single["engram_layers"] == layers
    assert single["token_map"]["files"] == {"engram.safetensors": "matches the tokenizer in use"}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["/nonexistent"], "PATH='/nonexistent' does not exist"),
        (["--config", "x.safetensors"], "--config='x.safetensors' is a checkpoint"),
    ],
)
def test_inspect_path_bad_input(capsys, args, needle) -> None:
    from engramrt.cli import main

    with pytest.raises(SystemExit) as info:
        main(["inspect", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in " ".join(err.split()) and "Traceback" not in err
