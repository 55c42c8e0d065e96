from __future__ import annotations

import pytest

from engramrt.cli import main


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), " ".join(out.split()), err


def test_demo_runs_and_checks_every_step(capsys) -> None:
    code, out, _ = _run(capsys, "demo", "--device", "cpu")
    assert code == 0
    assert "B prefix hit" in out and "rejected" in out and "checks passed" in out
    assert "NO" not in out


def test_demo_on_tiny_config_with_text(capsys) -> None:
    text = "The cat and THE CAT and the cat sat on the mat while the Cat slept on The Mat all day long, and the cat woke up."
    code, out, _ = _run(capsys, "demo", "--config", "tiny", "--text", text, "--device", "cpu")
    assert code == 0 and "checks passed" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--text", "too short"], "at least 24"), (["--file", "/nonexistent.txt"], "cannot be read")],
)
def test_demo_bad_input(capsys, args, needle) -> None:
    code, _, err = _run(capsys, "demo", "--device", "cpu", *args)
    assert code == 2 and needle in err
