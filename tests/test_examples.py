from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_loop_example_runs_clean(capsys, device) -> None:
    engine_loop = _load("engine_loop")
    assert engine_loop.main(["--device", str(device), "--requests", "4", "--steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "request-steps checked" in out
