"""Malformed command-line input: one line on stderr naming the option and value, exit code 2.

Each case is an input that once gave a traceback or was silently accepted
(see docs/reliability.md). In-process through :func:`engramrt.cli.main`
(what the ``engramrt`` entry point runs); one subprocess case checks the
real entry point end to end.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engramrt.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def _one_line_error(code: int, err: str, *needles: str) -> None:
    flat = " ".join(err.split())
    assert code == 2, err
    assert "Traceback" not in err
    assert flat.startswith("error:"), err
    for needle in needles:
        assert needle in flat, (needle, flat)


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "float.npy", np.array([1.5, 2.5, 3.0]))
    np.save(tmp_path / "ids2d.npy", np.array([[1, 2], [3, 4]]))
    np.save(tmp_path / "bool.npy", np.array([True, False]))
    np.save(tmp_path / "empty.npy", np.array([], dtype=np.int64))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "regular").write_text("x")
    cfg = {
        "engram_layer_ids": [1],
        "engram_vocab_size": 64,
        "engram_num_embeddings": 2000,
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
        "hidden_size": 64,
        "hc_mult": 2,
    }
    (tmp_path / "inf.json").write_text(json.dumps({**cfg, "rms_norm_eps": float("inf")}))
    (tmp_path / "neg_seed.json").write_text(json.dumps({**cfg, "engram_hash_seed": -1}))
    return tmp_path


HASH_CASES = [
    (["--ids", "1,9223372036854775808"], ["--ids=", "9223372036854775808", "int64"]),
    (["--ids", ",,,"], ["--ids=',,,'", "no integer"]),
    (["--ids", "1,2", "--out", "{d}/adir"], ["--out=", "adir", "is a directory"]),
    (["--ids", "1,2", "--out", "{d}/regular/x.npy"], ["--out=", "regular", "is a file"]),
    (["--ids-file", "{d}/float.npy"], ["--ids-file=", "float64", "integer token ids"]),
    (["--ids-file", "{d}/ids2d.npy"], ["--ids-file=", "shape [2, 2]", "1-D"]),
    (["--ids-file", "{d}/bool.npy"], ["--ids-file=", "bool", "integer token ids"]),
    (["--ids-file", "{d}/empty.npy"], ["--ids-file", "no token"]),
    (["--ids-file", "{d}/adir"], ["--ids-file=", "adir", "cannot be read"]),
    (["--text", ""], ["--text", "no token"]),
    (["--ids", "1", "--device", "bogus"], ["--device='bogus'", "cpu, cuda"]),
    (["--ids", "1", "--device", "tpu"], ["--device='tpu'", "cpu, cuda"]),
    (["--ids", "1", "--chunks", ""], ["--chunks=''", "no integer"]),
]


@pytest.mark.parametrize(("args", "needles"), HASH_CASES)
def test_hash_errors(capsys, files, args, needles) -> None:
    code, _, err = _run(capsys, "hash", "-c", "tiny", *(a.format(d=files) for a in args))
    _one_line_error(code, err, *needles)


def test_hash_no_gpu_is_an_error(capsys, files) -> None:
    import torch

    if torch.cuda.is_available():
        code, _, err = _run(capsys, "hash", "-c", "tiny", "--ids", "1", "--device", "cuda:99")
        _one_line_error(code, err, "--device='cuda:99'", "CUDA device(s) are visible")
    else:
        code, _, err = _run(capsys, "hash", "-c", "tiny", "--ids", "1", "--device", "cuda")
        _one_line_error(code, err, "--device='cuda'", "no CUDA device")


def test_demo_unknown_tier_with_a_checkpoint(capsys, tmp_path) -> None:
    """The message docs/reliability.md quotes (it had drifted from the code)."""
    import torch

    from engramrt.checkpoint import save_tables
    from engramrt.config import PRESETS
    from engramrt.lookup.synthetic import random_packed_rows

    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(0)
    tables = [random_packed_rows(n, cfg.head_dim, "cpu", gen) for n in cfg.num_embeddings]
    ckpt = save_tables(tmp_path / "engram.safetensors", tables, cfg)
    args = ["demo", "--synthetic", "-c", "tiny", "--device", "cpu", "--tier", "bogus"]
    code, _, err = _run(capsys, *args, "--checkpoint", ckpt, "--plot", tmp_path / "c.png")
    _one_line_error(
        code, err, "tier = 'bogus'; expected 'auto' or one of device, disk, host, synthetic, uva"
    )
    docs = (ROOT / "docs" / "reliability.md").read_text()
    assert "tier = 'bogus'; expected 'auto' or one of device, disk, host, synthetic, uva" in docs


@pytest.mark.parametrize("tp", ["abc", "1.5", ""])
def test_inspect_tp_not_an_integer_names_the_value(capsys, tp) -> None:
    """Was: a usage box without the value."""
    code, _, err = _run(capsys, "inspect", "-c", "tiny", "--tp", tp)
    _one_line_error(code, err, f"--tp={tp!r}; expected an integer")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["convert", "--tp", "abc", "a", "b"], "--tp='abc'; expected an integer"),
        (["convert", "--block-rows", "1e3", "a", "b"], "--block-rows='1e3'; expected an integer"),
        (["demo", "--max-new-tokens", "many"], "--max-new-tokens='many'; expected an integer"),
        (["demo", "--cache-mib", "x"], "--cache-mib='x'; expected a number"),
    ],
)
def test_numeric_options_name_the_value(capsys, args, needle) -> None:
    """Was: a usage box without the value (every numeric option is parsed from text)."""
    code, _, err = _run(capsys, *args)
    _one_line_error(code, err, needle)
    assert err.count("\n") == 1


@pytest.mark.parametrize("tp", ["1000", "13"])
def test_inspect_tp_past_the_columns_is_short(capsys, tp) -> None:
    code, _, err = _run(capsys, "inspect", "-c", "tiny", "--tp", tp)
    _one_line_error(code, err, f"--tp={tp}", "at most C=12")
    assert len(err) < 200


@pytest.mark.parametrize(
    ("name", "needles"),
    [("inf.json", ["rms_norm_eps=inf", "finite"]), ("neg_seed.json", ["hash_seed=-1"])],
)
def test_config_values_out_of_range(capsys, files, name, needles) -> None:
    code, _, err = _run(capsys, "inspect", "-c", files / name)
    _one_line_error(code, err, *needles)


DEMO_CASES = [
    (["--text", ""], ["--text=''", "empty"]),
    (["--text", "   "], ["--text=", "empty"]),
    (["--file", "{d}/empty.txt"], ["--file=", "empty.txt", "no text"]),
    (["--file", "{d}/blank.txt"], ["--file=", "blank.txt", "no text"]),
    (["--file", "{d}/adir"], ["--file=", "adir", "cannot be read"]),
    (["--device", "tpu"], ["--device='tpu'", "auto, cpu, cuda"]),
    (["--device", "bogus"], ["--device='bogus'", "auto, cpu, cuda"]),
    (["--plot", "{d}/adir"], ["--plot=", "adir", "is a directory"]),
    (["--plot", "{d}/regular/x.png"], ["--plot=", "regular", "is a file"]),
    (["--cache-mib", "inf"], ["--cache-mib=inf", "finite"]),
    (["--cache-mib", "nan"], ["--cache-mib=nan"]),
    (["--cache-mib", "-1"], ["--cache-mib=-1"]),
    (["--tier", "disk"], ["--tier='disk'", "give --checkpoint too"]),
    (["--tier", "disk", "--checkpoint", "{d}/regular"], ["--tier='disk'", "auto, device, uva"]),
]


@pytest.mark.parametrize(("args", "needles"), DEMO_CASES)
def test_demo_errors(capsys, files, args, needles) -> None:
    code, _, err = _run(
        capsys, "demo", "--synthetic", "-c", "tiny", *(a.format(d=files) for a in args)
    )
    _one_line_error(code, err, *needles)


BENCH_CASES = [
    (["--group", "nosuch", "--device", "cpu"], ["--group 'nosuch'", "hash", "lookup"]),
    # Unknown groups are named before any device check, on every machine.
    (["--group", "nosuch", "--device", "cuda:7"], ["--group 'nosuch'", "no such benchmark group"]),
    # Every case times a CUDA kernel: a CPU run does nothing, so it says so and fails.
    (["--device", "cpu"], ["--device='cpu'", "time CUDA kernels", "nothing was run"]),
    (
        ["--group", "hash", "--device", "cpu"],
        ["selected benchmark cases time CUDA kernels", "nothing was run"],
    ),
    (["--device", "tpu"], ["--device='tpu'"]),
    (["--device", "bogus"], ["--device='bogus'"]),
    (["--device", "cpu", "--out", "{d}/adir"], ["--out=", "is a directory"]),
    (["--device", "cpu", "--markdown", "{d}/regular/t.md"], ["--markdown=", "is a file"]),
]


@pytest.mark.parametrize(("args", "needles"), BENCH_CASES)
def test_bench_errors(capsys, files, args, needles) -> None:
    if "cuda:7" in args and __import__("torch").cuda.device_count() > 7:
        pytest.skip("needs a machine without an eighth GPU")
    code, _, err = _run(capsys, "bench", "--quick", *(a.format(d=files) for a in args))
    _one_line_error(code, err, *needles)


def _subcommands() -> list[str]:
    from engramrt.cli import app

    return sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def test_the_sweep_covers_every_subcommand() -> None:
    assert set(_subcommands()) == {"bench", "convert", "demo", "hash", "inspect", "plan"}


@pytest.mark.parametrize("command", _subcommands())
def test_no_subcommand_exits_0_having_done_nothing(capsys, command) -> None:
    """Each subcommand, as cheaply as it can be called (no arguments, or on a CPU): it either
    fails with one line or prints what it did. ``demo`` with no arguments is the full demo,
    covered by tests/cli/test_demo_model.py; here it is called with an option it refuses."""
    args = {"bench": ["--device", "cpu"], "demo": ["--synthetic", "--json"]}.get(command, [])
    code, out, err = _run(capsys, command, *args)
    if code == 0:
        assert out.strip(), f"engramrt {command} {' '.join(args)} exited 0 and printed nothing"
    else:
        assert code == 2 and err.strip() and "Traceback" not in err, (command, code, err)


@pytest.fixture
def source(tmp_path):
    """Float source tables of the tiny preset (random, one per layer)."""
    import torch
    from safetensors.torch import save_file

    from engramrt.config import PRESETS

    tiny = PRESETS["tiny"]
    generator = torch.Generator().manual_seed(0)
    path = tmp_path / "src.safetensors"
    save_file(
        {
            f"engram.{layer}.weight": torch.randn(rows, tiny.head_dim, generator=generator)
            for layer, rows in zip(tiny.layer_ids, tiny.num_embeddings, strict=True)
        },
        str(path),
    )
    return path


CONVERT_CASES = [
    (["--device", "bogus"], ["--device='bogus'"]),
    (["--device", "tpu"], ["--device='tpu'"]),
    (["--tp", "0"], ["--tp=0"]),
    (["--tp", "-2"], ["--tp=-2"]),
    (["--block-rows", "-1"], ["--block-rows=-1"]),
    (["--tp", "1000"], ["--tp=1000", "at most C=12"]),
]


@pytest.mark.parametrize(("args", "needles"), CONVERT_CASES)
def test_convert_option_errors(capsys, tmp_path, source, args, needles) -> None:
    code, _, err = _run(capsys, "convert", source, tmp_path / "dst", "-c", "tiny", *args)
    _one_line_error(code, err, *needles)
    assert not (tmp_path / "dst").exists()


def test_convert_without_gpu(capsys, tmp_path, source) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = _run(
        capsys, "convert", source, tmp_path / "dst", "-c", "tiny", "--device", "cuda"
    )
    _one_line_error(code, err, "--device='cuda'", "no CUDA device")


def test_convert_under_a_regular_file(capsys, tmp_path, source) -> None:
    (tmp_path / "regular").write_text("x")
    code, _, err = _run(capsys, "convert", source, tmp_path / "regular" / "dst", "-c", "tiny")
    _one_line_error(code, err, "DST=", "regular", "is a file")


@pytest.mark.parametrize(
    ("error", "needles"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), ["No space left", "DST="]),
        (PermissionError(errno.EACCES, "Permission denied"), ["Permission denied", "DST="]),
    ],
)
def test_convert_write_failure_is_clean(
    capsys, tmp_path, source, monkeypatch, error, needles
) -> None:
    """A full disk or a read-only destination mid-write: one line, and no file left behind."""
    from engramrt.checkpoint.safetensors_format import SafetensorsStreamWriter

    real_append = SafetensorsStreamWriter.append
    calls = {"n": 0}

    def append(self, name, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise error
        real_append(self, name, data)

    monkeypatch.setattr(SafetensorsStreamWriter, "append", append)
    dst = tmp_path / "dst"
    code, _, err = _run(capsys, "convert", source, dst, "-c", "tiny", "--block-rows", "5000")
    _one_line_error(code, err, *needles)
    assert calls["n"] == 3
    assert list(dst.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_convert_into_read_only_directory(capsys, tmp_path, source) -> None:
    dst = tmp_path / "ro"
    dst.mkdir(mode=0o555)
    code, _, err = _run(capsys, "convert", source, dst, "-c", "tiny")
    _one_line_error(code, err, "DST=", "Permission denied")


def test_entry_point_prints_one_line(tmp_path) -> None:
    """The installed console script: exit 2, one stderr line, nothing on stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "engramrt.cli", "hash", "-c", "tiny", "--ids", "1,2**70"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--ids='1,2**70'" in done.stderr
    assert done.stdout == ""
