from __future__ import annotations

import pytest

from engramrt.cli import main


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), " ".join(out.split()), err


def test_demo_runs_and_checks_every_step(capsys, tmp_path) -> None:
    chart = tmp_path / "demo.png"
    code, out, _ = _run(capsys, "demo", "--device", "cpu", "--plot", str(chart))
    assert code == 0
    assert "B prefix hit" in out and "rejected" in out and "checks passed" in out
    assert "row lookup" in out and "fused gate" in out
    assert "NO" not in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_on_tiny_config_with_text(capsys, tmp_path) -> None:
    text = "The cat and THE CAT and the cat sat on the mat while the Cat slept on The Mat all day long, and the cat woke up."
    code, out, _ = _run(
        capsys,
        "demo",
        "--config",
        "tiny",
        "--text",
        text,
        "--device",
        "cpu",
        "--plot",
        str(tmp_path / "c.png"),
    )
    assert code == 0 and "checks passed" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--text", "too short"], "at least 24"), (["--file", "/nonexistent.txt"], "cannot be read")],
)
def test_demo_bad_input(capsys, args, needle) -> None:
    code, _, err = _run(capsys, "demo", "--device", "cpu", *args)
    assert code == 2 and needle in err
