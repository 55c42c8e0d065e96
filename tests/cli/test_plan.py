"""``engramrt plan``: rows, row bytes, format, total and per-rank bytes of every table.

Qwen4-Exp numbers are checked against docs/families.md and SPEC_PLE's figures (the real
table: 320,001,536 rows of d = 160 bf16 values) and against rows computed here from §2
(primes by trial division) for a small config whose width does not divide evenly; DeepSeek
Engram's against the SPEC's row counts and the layout's own column shards
(``EngramLayout.column_shard``, the path ``inspect`` has always used). A control shards the
PLE table like Engram's and sees the numbers change.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engramrt.cli import main

LIN, FULL = "linear_attention", "full_attention"

# The real PLE table (SPEC_PLE §1-§2): ple_layer_ids [2], E = 2560, the default hash
# constants: R = 320,001,536 rows of d = 2560 / 16 = 160 bf16 values (320 B).
REAL_PLE = {
    "model_type": "qwen4_exp_text",
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "hidden_size": 2048,
    "eos_token_id": 248044,
}
REAL_ROWS = 320_001_536

# Small, with d = 40 / 4 = 10 values: tp = 3 and 4 split it unevenly, tp = 8 leaves ranks
# without a value (ceil(10 / 8) = 2: five ranks hold them all).
SMALL_PLE = {
    "model_type": "qwen4_exp_text",
    "ple_layer_ids": [1, 2],
    "ple_embed_dim": 40,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 64,
    "vocab_size": 300,
    "eos_token_id": 7,
    "hidden_size": 16,
    "num_hidden_layers": 4,
    "layer_types": [LIN, LIN, LIN, FULL],
}

# DeepSeek-V4.1-Flash (SPEC §1): 384,006,168 and 384,016,682 rows of 264 B.
DSV41_ROWS = (384_006_168, 384_016_682)


def _run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def _plan(capsys, *args: object) -> dict[str, Any]:
    code, out, err = _run(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def _write(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _spec_table_rows(base: int, layers: int, cols: int, divisor: int) -> list[int]:
    """docs/families.md §2: layer l owns primes l*C+1 .. l*C+C at or above ``base``; its rows
    are their sum rounded up to a multiple of ``divisor``."""
    primes, candidate = [], base
    while len(primes) < layers * cols:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    sums = [sum(primes[l * cols : (l + 1) * cols]) for l in range(layers)]  # noqa: E741
    return [-(-s // divisor) * divisor for s in sums]


# -- Qwen4-Exp PLE: tables split by width -------------------------------------------------


def test_real_ple_table_has_the_spec_numbers(capsys, tmp_path) -> None:
    report = _plan(capsys, "--config", _write(tmp_path, REAL_PLE))
    assert report["family"] == "qwen4-ple"
    (table,) = report["tables"]
    assert table == {
        "layer_id": 2,
        "rows": REAL_ROWS,
        "width": 160,
        "row_format": "bf16",
        "row_bytes": 320,
        "nbytes": REAL_ROWS * 320,
        "num_cols": 16,
        "shard": "width",
    }
    assert round(report["total_bytes"] / 2**30, 1) == 95.4  # SPEC_PLE: "95.4 GiB bf16"
    assert [entry["tp"] for entry in report["tp"]] == [1, 2, 4, 8] and not report["skipped_tp"]
    for entry in report["tp"]:
        tp = entry["tp"]
        (part,) = entry["tables"]
        assert part["rank_rows"] == [REAL_ROWS] * tp  # every rank holds every row
        assert part["rank_values"] == [160 // tp] * tp
        assert part["rank_bytes"] == [REAL_ROWS * (160 // tp) * 2] * tp
        assert entry["max_rank_bytes"] == REAL_ROWS * 320 // tp
        assert entry["node_bytes"] == REAL_ROWS * 320


def test_uneven_width_split_follows_torch_chunk(capsys, tmp_path) -> None:
    config = _write(tmp_path, {"model_type": "qwen4_exp", "text_config": SMALL_PLE})
    report = _plan(capsys, "-c", config, "--tp", "1,3,4,2")
    rows = _spec_table_rows(1000, layers=2, cols=4, divisor=64)
    assert [t["rows"] for t in report["tables"]] == rows
    assert [t["nbytes"] for t in report["tables"]] == [r * 20 for r in rows]
    chunks = {1: [10], 2: [5, 5], 3: [4, 4, 2], 4: [3, 3, 3, 1]}  # torch.chunk(range(10), tp)
    assert [entry["tp"] for entry in report["tp"]] == [1, 3, 4, 2]
    for entry in report["tp"]:
        values = chunks[entry["tp"]]
        for part, table_rows in zip(entry["tables"], rows, strict=True):
            assert part["rank_values"] == values
            assert part["rank_bytes"] == [table_rows * v * 2 for v in values]
        assert entry["rank_bytes"] == [sum(rows) * v * 2 for v in values]
        assert entry["max_rank_bytes"] == sum(rows) * values[0] * 2


def test_a_tp_that_leaves_a_rank_without_values(capsys, tmp_path) -> None:
    """Named with --tp: an error; among the defaults: listed as not planned."""
    config = _write(tmp_path, SMALL_PLE)
    message = (
        "tp=8 leaves rank(s) [5, 6, 7] without a value of the rows of layer 1: d=10 values in "
        "parts of ceil(10/8)=2; choose tp so that (tp-1)*ceil(d/tp) < d"
    )
    code, _, err = _run(capsys, "plan", "-c", config, "--tp", "2,8")
    assert code == 2 and " ".join(err.split()) == f"error: --tp='2,8': {message}"
    report = _plan(capsys, "-c", config)
    assert [entry["tp"] for entry in report["tp"]] == [1, 2, 4]
    assert report["skipped_tp"] == [{"tp": 8, "reason": message}]
    code, out, _ = _run(capsys, "plan", "-c", config)
    assert code == 0 and f"tp=8 not planned: {message}" in " ".join(out.split())


def test_control_ple_sharded_like_engram_gives_other_numbers(tmp_path) -> None:
    """Were the PLE table split by hash columns, a rank would hold a range of rows of full
    width, and the test above (the SPEC's per-rank bytes) would fail."""
    from engramrt.families.qwen4_ple.family import Qwen4PleFamily
    from engramrt.plan import table_shards

    (table,) = Qwen4PleFamily(REAL_PLE).tables()
    by_columns = table_shards(dataclasses.replace(table, shard="columns"), 4)
    assert [s.nbytes for s in by_columns] != [REAL_ROWS * 40 * 2] * 4
    assert [s.nbytes for s in table_shards(table, 4)] == [REAL_ROWS * 40 * 2] * 4


def test_width_rule_is_the_checkpoint_readers() -> None:
    """plan.width_slice and the checkpoint's PleTableRegion.width_shard split alike."""
    from engramrt.families.qwen4_ple.checkpoint import PleTableRegion
    from engramrt.plan import width_slice

    for width in (1, 7, 10, 160):
        for tp in range(1, 12):
            for rank in range(tp):
                region = PleTableRegion.width_shard(5, width, tp, rank)
                assert width_slice(width, tp, rank) == (region.value_begin, region.value_end)


# -- DeepSeek Engram: tables split by hash columns -----------------------------------------


def test_engram_preset_by_columns(capsys) -> None:
    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    report = _plan(capsys, "--config", "dsv41-flash")
    assert report["family"] == "deepseek-engram"
    assert [(t["rows"], t["row_bytes"], t["row_format"], t["shard"]) for t in report["tables"]] == [
        (rows, 264, "fp8-ue8m0-32", "columns") for rows in DSV41_ROWS
    ]
    assert report["total_bytes"] == sum(DSV41_ROWS) * 264
    layout = EngramLayout(PRESETS["dsv41-flash"])
    for entry in report["tp"]:
        tp = entry["tp"]
        for index, part in enumerate(entry["tables"]):
            want = [layout.column_shard(index, tp, r).num_rows for r in range(tp)]
            assert part["rank_rows"] == (want if tp > 1 else [DSV41_ROWS[index]])
            assert part["rank_values"] == [256] * tp  # every value of its rows
            assert part["rank_bytes"] == [rows * 264 for rows in part["rank_rows"]]
            assert sum(part["rank_rows"]) == DSV41_ROWS[index]  # the columns cover the table
        assert entry["node_bytes"] == sum(DSV41_ROWS) * 264


def test_engram_plan_equals_inspect(capsys) -> None:
    """``inspect``'s memory plan (rank rows from the layout) and ``plan`` agree at every tp."""
    for tp in (1, 2, 4, 8):
        code, out, _ = _run(capsys, "inspect", "-c", "dsv41-flash", "--tp", str(tp), "--json")
        assert code == 0
        inspected = json.loads(out)
        (entry,) = _plan(capsys, "-c", "dsv41-flash", "--tp", str(tp))["tp"]
        gpu = next(p for p in inspected["memory_plan"] if p["placement"] == "gpu")
        assert entry["max_rank_bytes"] == gpu["gpu_bytes_per_rank"]
        assert [list(r) for r in zip(*(t["rank_rows"] for t in entry["tables"]), strict=True)] == (
            inspected["rank_rows"]
        )


def test_tiny_skips_tp_8_and_a_named_one_is_an_error(capsys) -> None:
    report = _plan(capsys, "-c", "tiny")
    assert [entry["tp"] for entry in report["tp"]] == [1, 2, 4]
    message = (
        "tp=8 leaves rank(s) [6, 7] without a hash column: C=12 columns in parts of "
        "ceil(12/8)=2; choose tp so that (tp-1)*ceil(C/tp) < C"
    )
    assert report["skipped_tp"] == [{"tp": 8, "reason": message}]
    code, _, err = _run(capsys, "plan", "-c", "tiny", "--tp", "8")
    assert code == 2 and " ".join(err.split()) == f"error: --tp='8': {message}"


def test_human_output(capsys, tmp_path) -> None:
    code, out, err = _run(capsys, "plan", "-c", _write(tmp_path, REAL_PLE), "--tp", "1,8")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "(qwen4-ple): 1 table(s) of bf16 rows, 95.37 GiB (102,400,491,520 B)" in flat
    assert "splits them by row width" in flat
    assert "2 320,001,536 320 95.37 95.37 11.92" in flat  # layer, rows, row B, total, tp=1, 8
    code, out, _ = _run(capsys, "plan")
    assert code == 0 and "dsv41-flash (deepseek-engram)" in out and "hash columns" in out


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "abc"], "--tp='abc' must be comma-separated integers"),
        (["--tp", "2,0"], "--tp='2,0' holds 0; expected tensor-parallel sizes >= 1"),
        (["--tp", "-4"], "--tp='-4' holds -4; expected tensor-parallel sizes >= 1"),
        (
            ["--tp", "13"],
            "--tp='13': tp=13 leaves rank(s) [12] without a hash column: C=12 columns in parts "
            "of ceil(12/13)=1; choose tp so that (tp-1)*ceil(C/tp) < C",
        ),
        (
            ["-c", "nosuch"],
            "config='nosuch' is neither a preset (dsv41-flash, tiny) nor an existing file",
        ),
    ],
)
def test_bad_options_are_one_exact_line(capsys, args, message) -> None:
    code, _, err = _run(capsys, "plan", *(["-c", "tiny"] if "-c" not in args else []), *args)
    assert code == 2 and "Traceback" not in err
    assert " ".join(err.split()) == f"error: {message}"


def test_ple_off_is_refused(capsys, tmp_path) -> None:
    off = _write(tmp_path, {**SMALL_PLE, "ple_layer_ids": None})
    code, _, err = _run(capsys, "plan", "-c", off)
    assert code == 2 and " ".join(err.split()) == (
        f"error: --config='{off}' has ple_layer_ids=null (PLE off); expected a list of at "
        f"least one one-indexed decoder layer with PLE, e.g. [2]"
    )


# -- the family registry names a config's family ---------------------------------------------


def test_family_of_config_reads_model_type_then_fields(monkeypatch) -> None:
    import engramrt.family as family_module
    from engramrt.errors import ValidationError
    from engramrt.family import family_of_config, register_family

    assert family_of_config({"model_type": "qwen4_exp"}) == "qwen4-ple"
    text_only = {"model_type": "x", "text_config": {"model_type": "qwen4_exp_text"}}
    assert family_of_config(text_only) == "qwen4-ple"
    assert family_of_config({"ple_layer_ids": None}) == "qwen4-ple"
    assert family_of_config({"text_config": {"ple_embed_dim": 8}}) == "qwen4-ple"
    assert family_of_config({"engram_layer_ids": [1]}) == "deepseek-engram"
    assert family_of_config({"model_type": "llama", "hidden_size": 8}) is None
    # A model_type decides before fields.
    assert family_of_config({"model_type": "qwen4_exp", "engram_layer_ids": [1]}) == "qwen4-ple"
    with pytest.raises(ValidationError, match=r"^cfg is a list; expected a JSON object$"):
        family_of_config([], what="cfg")  # type: ignore[arg-type]
    monkeypatch.setattr(family_module, "_REGISTRY", dict(family_module._REGISTRY))
    monkeypatch.setattr(family_module, "_MARKERS", dict(family_module._MARKERS))
    register_family("other", "pkg.mod:Family", model_types=["qwen4_exp"], config_fields=["x"])
    with pytest.raises(
        ValidationError,
        match=r"^config has model_type \['qwen4_exp'\], claimed by the families "
        r"\['other', 'qwen4-ple'\]; expected a config of one family$",
    ):
        family_of_config({"model_type": "qwen4_exp"})
    assert family_of_config({"x": 1}) == "other"
    with pytest.raises(ValidationError, match=r"^model_types='abc' for family 'bad'; expected"):
        register_family("bad", "pkg.mod:Family", model_types="abc")


def test_help_lists_plan_and_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from engramrt.cli import app\n"
        "from typer.testing import CliRunner\n"
        "out = CliRunner().invoke(app, ['--help']).output\n"
        "print('plan' in out, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["True", "False"]


# -- inspect of a Qwen4-Exp config ----------------------------------------------------------


def test_inspect_ple_config_shows_its_hashing(capsys, tmp_path) -> None:
    """``inspect -c`` of a Qwen4-Exp config: each head's prime and first row as the spec
    derives them (primes counted here by trial division), the family's fingerprint and
    the plan's bytes; the text output shows the same numbers."""
    from engramrt.families.qwen4_ple.family import Qwen4PleFamily

    path = _write(tmp_path, SMALL_PLE)
    code, out, err = _run(capsys, "inspect", "-c", path, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["family"] == "qwen4-ple" and report["ple_layer_ids"] == [1, 2]
    primes, candidate = [], 1000
    while len(primes) < 2 * 4:
        primes += [candidate] if _is_prime(candidate) else []
        candidate += 1
    assert report["head_sizes"] == [primes[:4], primes[4:]]
    assert report["offsets"] == [[0, *np.cumsum(p[:3]).tolist()] for p in (primes[:4], primes[4:])]
    assert report["table_rows"] == _spec_table_rows(1000, 2, 4, 64)
    assert report["fingerprint"] == Qwen4PleFamily(SMALL_PLE).fingerprint()
    assert report["memory_plan"]["total_bytes"] == sum(r * 20 for r in report["table_rows"])
    code, out, _ = _run(capsys, "inspect", "-c", path)
    assert code == 0
    assert f"{primes[5]:,}" in out and report["fingerprint"] in out
    code, _, err = _run(capsys, "inspect", "-c", path, "--tokenizer", path)
    assert code != 0 and "--tokenizer and --checkpoint are for DeepSeek Engram configs" in err


def test_inspect_path_of_a_ple_checkpoint(capsys, tmp_path) -> None:
    """``inspect PATH`` lists a Qwen4-Exp checkpoint's PLE tensors, by family and layer."""
    from tests.families.qwen4_ple import ple_checkpoints as ckpt

    state = ckpt.checkpoint_state(ckpt.COMPOSITE)
    path = ckpt.save(tmp_path / "model", state)
    code, out, err = _run(capsys, "inspect", path, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["families"] == ["qwen4-ple"] and report["engram_layers"] == [0, 2]
    assert {t["name"] for t in report["engram_tensors"]} == set(state)
