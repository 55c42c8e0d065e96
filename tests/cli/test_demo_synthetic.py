from __future__ import annotations

import pytest
import torch

from engramrt.cli import main


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    """The demo as a CPU user runs it: the torch references, not the Triton interpreter
    (the kernels behind the same calls are checked in tests/hashing, tests/lookup and
    tests/layer; under the interpreter one run of this demo takes minutes)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    capsys.raw = out  # the unflattened text, for parsing tables
    return int(info.value.code or 0), " ".join(out.split()), err


def _tiny_demo(capsys, text: str, *args: str) -> tuple[int, str, str]:
    """``engramrt demo --synthetic`` on the tiny config and the CPU, over ``text``."""
    return _run(
        capsys, "demo", "--synthetic", "--config", "tiny", "--text", text, "--device", "cpu", *args
    )


def test_demo_runs_and_checks_every_step(capsys, tmp_path) -> None:
    chart = tmp_path / "demo.png"
    code, out, _ = _run(capsys, "demo", "--synthetic", "--device", "cpu", "--plot", str(chart))
    assert code == 0
    assert "B prefix hit" in out and "rejected" in out and "checks passed" in out
    assert "Engram layer 1 (lookup + wkv + gate), whole text" in out
    assert "hot-row cache (16 MiB per layer)" in out  # on by default, stats shown
    assert "NO" not in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart: {chart.resolve()}" in out
    # It says what is synthetic: the rows, the weights and the hidden states.
    assert "synthetic: rows computed from their row ids" in out
    assert "the wkv, q and k weights and the hidden states (random" in out
    from engramrt_lab.cli.demo_synthetic import DEFAULT_TEXT

    assert _first_tokens_rows(capsys.raw) == _independent_first_tokens(DEFAULT_TEXT)


def test_demo_on_tiny_config_with_text(capsys, tmp_path) -> None:
    text = "The cat and THE CAT and the cat sat on the mat while the Cat slept on The Mat all day long, and the cat woke up."
    code, out, _ = _tiny_demo(capsys, text, "--plot", str(tmp_path / "c.png"))
    assert code == 0 and "checks passed" in out
    assert _first_tokens_rows(capsys.raw) == _independent_first_tokens(text)


def _first_tokens_rows(raw: str) -> list[tuple[int, int, int, int]]:
    """(pos, token id, compressed id, ids sharing it) parsed from the demo's first-tokens table."""
    rows = []
    table = raw.split("first tokens", 1)[1].split("bigrams", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append((int(cells[0]), int(cells[2]), int(cells[3]), int(cells[4])))
    return rows


def _independent_first_tokens(text: str) -> list[tuple[int, int, int, int]]:
    """The same numbers from the tokenizer and the token map's array, not the demo's code."""
    import numpy as np

    from engramrt.tokenmap import TokenMap, load_tokenizer

    table = TokenMap.from_tokenizer_file().map
    ids = load_tokenizer().encode(text, add_special_tokens=False).ids[:12]
    return [
        (p, t, int(table[t]), int(np.count_nonzero(table == table[t]))) for p, t in enumerate(ids)
    ]


def test_control_a_wrong_token_map_fails_the_independent_check(capsys, tmp_path, monkeypatch):
    from engramrt.tokenmap import TokenMap

    real = TokenMap.compress
    monkeypatch.setattr(TokenMap, "compress", lambda self, ids: real(self, ids) + 1)
    text = "The cat and THE CAT and the cat sat on the mat while the Cat slept on The Mat all day long, and the cat woke up."
    with pytest.raises(SystemExit):
        main(
            ["demo", "--synthetic", "-c", "tiny", "--text", text, "--plot", str(tmp_path / "c.png")]
        )
    capsys.raw = capsys.readouterr().out
    parsed = _first_tokens_rows(capsys.raw)
    assert len(parsed) == 12 and parsed != _independent_first_tokens(text)


def test_demo_without_a_cache(capsys, tmp_path, monkeypatch) -> None:
    import engramrt.cache

    def no_cache(*args, **kwargs):
        raise AssertionError("a CachedRowStore was built with --cache-mib 0")

    monkeypatch.setattr(engramrt.cache, "CachedRowStore", no_cache)
    code, out, _ = _run(
        capsys,
        "demo",
        "--synthetic",
        "--config",
        "tiny",
        "--device",
        "cpu",
        "--cache-mib",
        "0",
    )
    assert code == 0 and "checks passed" in out and "hot-row cache (" not in out
    assert "chart:" not in out  # no --plot, no chart
    from engramrt_lab.cli.demo_synthetic import DEFAULT_TEXT

    # Independent of the demo's verdict: its token table from the tokenizer and the map here.
    assert _first_tokens_rows(capsys.raw) == _independent_first_tokens(DEFAULT_TEXT)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--text", "too short"], "at least 24"),
        (["--file", "/nonexistent.txt"], "cannot be read"),
        (["--cache-mib", "-1"], "--cache-mib=-1.0; expected a finite size in MiB >= 0"),
    ],
)
def test_demo_bad_input(capsys, args, needle) -> None:
    code, _, err = _run(capsys, "demo", "--synthetic", "--device", "cpu", *args)
    assert code == 2 and needle in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--history", "bogus"], "--history is for the model demo"),
        (["--model", "/nonexistent"], "--model is for the model demo"),
        (["--max-new-tokens", "8"], "--max-new-tokens is for the model demo"),
        (["--full-eval"], "--full-eval is for the model demo"),
        (["--json", "--history", "slot"], "--history, --json are for the model demo"),
        (["--tier", "uva"], "--tier='uva' places a checkpoint's tables"),
    ],
)
def test_synthetic_refuses_options_it_does_not_use(capsys, args, needle) -> None:
    code, out, err = _run(capsys, "demo", "--synthetic", *args)
    assert code == 2 and needle in err and out == ""  # refused before any work


def test_demo_serves_rows_from_a_checkpoint(capsys, tmp_path, monkeypatch) -> None:
    import engramrt.checkpoint
    from engramrt.checkpoint import save_tables

    real_load_table = engramrt.checkpoint.load_table
    served = []

    def recording_load_table(*args, **kwargs):
        served.append(real_load_table(*args, **kwargs))
        return served[-1]

    monkeypatch.setattr(engramrt.checkpoint, "load_table", recording_load_table)
    from engramrt.config import PRESETS
    from engramrt.lookup.synthetic import random_packed_rows

    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(0)
    tables = [random_packed_rows(n, cfg.head_dim, "cpu", gen) for n in cfg.num_embeddings]
    ckpt = save_tables(tmp_path / "engram.safetensors", tables, cfg)
    text = "The cat and THE CAT and the cat sat on the mat while the Cat slept on The Mat all day, and the cat woke up."
    code, out, _ = _tiny_demo(
        capsys, text, "--checkpoint", str(ckpt), "--tier", "host", "--plot", str(tmp_path / "c.png")
    )
    assert code == 0 and "checks passed" in out
    # Independent of that verdict: the stores served hold exactly the tables saved here.
    assert len(served) == len(tables)
    for store, table in zip(served, tables, strict=True):
        got = store.gather_packed(torch.arange(table.shape[0]))
        assert torch.equal(got.cpu(), table.cpu())
    code, _, err = _tiny_demo(
        capsys, text, "--checkpoint", str(tmp_path / "missing"), "--plot", str(tmp_path / "d.png")
    )
    assert code == 2 and "does not exist" in err


def test_a_checkpoint_of_another_config_reports_its_shape_not_memory(capsys, tmp_path) -> None:
    """A tiny model's checkpoint under ``-c dsv41-flash``: the shape mismatch is the
    error, read from the headers before tier auto sizes memory for the flash tables
    (was: ``tier='auto' needs ... (94.42 GiB)``)."""
    from engramrt.checkpoint import save_tables
    from engramrt.config import PRESETS
    from engramrt.lookup.synthetic import random_packed_rows

    tiny, flash = PRESETS["tiny"], PRESETS["dsv41-flash"]
    assert tiny.head_dim != flash.head_dim
    gen = torch.Generator().manual_seed(0)
    tables = [random_packed_rows(n, tiny.head_dim, "cpu", gen) for n in tiny.num_embeddings]
    ckpt = save_tables(tmp_path / "engram.safetensors", tables, tiny)
    code, _, err = _run(
        capsys,
        "demo",
        "--synthetic",
        "-c",
        "dsv41-flash",
        "--checkpoint",
        str(ckpt),
        "--device",
        "cpu",
    )
    assert code == 2
    first = flash.layer_ids[0]
    rows = tables[0].shape[0]
    assert err.strip() == (
        f"error: tensor 'layers.{first}.engram.embed.weight' in engram.safetensors (layer "
        f"{first} weight) has shape [{rows}, {tiny.head_dim}]; expected "
        f"[{rows}, {flash.head_dim}] (engram_head_dim = {flash.head_dim})"
    )
    assert "GiB" not in err
