"""The scripts under bench/ that CI can run: the results renderer and the multi-GPU check on gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(date: str, cases: list[tuple[str, float]], quick: bool = False) -> dict:
    return {
        "environment": {"date": date, "device": "cuda", "gpu": "GPU", "torch": "t", "triton": "t"},
        "quick": quick,
        "ceilings_bytes_per_s": {"d2d": 4e12, "h2d": 5e10},
        "cases": [
            {
                "name": name,
                "group": name.split("/")[0],
                "status": "ok",
                "baseline": "base",
                "ceiling": "d2d",
                "item_name": "rows",
                "results": {
                    "base": {
                        "median_us": us,
                        "eager_wall_us": us,
                        "items_per_s": 1e6,
                        "gb_per_s": 1.0,
                        "speedup_vs_baseline": 1.0,
                    }
                },
            }
            for name, us in cases
        ],
    }


def test_render_takes_each_cases_newest_full_size_record(tmp_path, monkeypatch) -> None:
    results = tmp_path / "results"
    results.mkdir()
    reports = {
        "bench-lookup-1.json": _report(
            "2026-01-01T00:00:00", [("lookup/a", 111.0), ("lookup/b", 222.0)]
        ),
        "bench-lookup-2.json": _report(
            "2026-01-02T00:00:00", [("lookup/b", 333.0)]
        ),  # one case rerun
        "bench-lookup-3.json": _report("2026-01-03T00:00:00", [("lookup/a", 999.0)], quick=True),
    }
    for name, report in reports.items():
        (results / name).write_text(json.dumps(report))
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("head\n<!-- results:start -->\nstale rendering\n<!-- results:end -->\ntail\n")
    monkeypatch.setattr(sys, "argv", ["render", str(results), str(target)])
    _load("render_benchmarks").main()
    text = target.read_text()
    assert text.startswith("head\n<!-- results:start -->") and text.endswith(
        "<!-- results:end -->\ntail\n"
    )
    assert "stale rendering" not in text and "### lookup" in text
    assert "| lookup/a | base (baseline) | 111.0 |" in text  # the quick run is not rendered
    assert "| lookup/b | base (baseline) | 333.0 |" in text and "222.0" not in text
    assert "2026-01-01" in text and "2026-01-02" in text  # each table keeps its run's header


def test_multi_gpu_script_on_gloo(tmp_path) -> None:
    """Two gloo processes: TP, sequence-parallel, all-to-all, a shared host table and the layer
    equal one process; the shared table is loaded once and removed afterwards."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(ROOT / "bench" / "multi_gpu.py"),
        "--cpu",
        "--tokens",
        "5",
        "--table-gib",
        "0.02",
        "--reps",
        "1",
        "--out",
        str(out),
        "--shared-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        pytest.fail(
            f"multi_gpu.py exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and report["backend"] == "gloo" and report["failures"] == []
    what = {r["what"] for r in report["results"]}
    assert {
        "AllGatherExchange all_gather",
        "SequenceParallelExchange all_to_all",
        "AllToAllExchange",
    } <= what
    assert {"EngramLayer SP reduce_scatter", "EngramLayer SP all_to_all"} <= what
    assert {"SharedHostTable load once, map", "shared host table, host tier"} <= what
    assert all(r["exact"] for r in report["results"])
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    # Independent of the script's own verdict: the rows it gathered, recomputed here
    # with the lookup reference over the same synthetic table.
    digests = {r["what"]: r["rows_sha256"] for r in report["results"] if "rows_sha256" in r}
    assert set(digests) == {"AllGatherExchange all_gather", "AllGatherExchange all_reduce"}
    expected = _gathered_rows_digest(table_gib=0.02, num_tokens=5, seed=5)
    assert digests == dict.fromkeys(digests, expected)
    # The control: other rows give another digest, so the comparison above can fail.
    assert _gathered_rows_digest(table_gib=0.02, num_tokens=5, seed=6) != expected


def _gathered_rows_digest(*, table_gib: float, num_tokens: int, seed: int) -> str:
    """SHA-256 of the rows multi_gpu.py's exchanges must return: ids drawn as the script
    draws them, rows by the lookup reference over the synthetic table."""
    import hashlib

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from multi_gpu import random_ids
        from runtime_overhead import scaled_config
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from engramrt.layout import EngramLayout
    from engramrt.lookup import lookup_rows_reference
    from engramrt.runtime import synthetic_stores

    layout = EngramLayout(scaled_config(table_gib))
    (store,) = synthetic_stores(layout, "device", device="cpu", seed=1)[:1]
    ids = random_ids(layout, num_tokens, seed=seed)
    rows = lookup_rows_reference(ids, store.table, layout.config.head_dim)
    return hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()
