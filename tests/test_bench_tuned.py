"""``engramrt bench --write-config``: each tuning case's fastest checked config is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from engramrt import tuning
from engramrt.bench.registry import all_cases
from engramrt.bench.runner import tuning_record
from engramrt.bench.tuned import best_configs, write_configs
from engramrt.errors import ValidationError
from engramrt.hashing.config import HashKernelConfig, kernel_config_for


def test_tuning_cases_name_configs_their_impls_launch() -> None:
    cases = [c for c in all_cases(False, ["hash", "gate", "lookup"]) if c.tuning is not None]
    kernels = {c.tuning.kernel for c in cases if c.tuning is not None}
    assert kernels == {"ngram_hash", "engram_gate", "lookup_rows"}
    for case in cases:
        assert case.tuning is not None
        assert set(case.tuning.configs) <= set(case.impls), case.name
        json.dumps(tuning_record(case.tuning))  # a report stays JSON
    buckets = [c.tuning.match for c in cases if c.tuning and c.tuning.kernel == "ngram_hash"]
    assert {} in buckets  # a catch-all entry for every larger batch


def _record(match: dict[str, Any], times: dict[str, float], status: str = "ok") -> dict[str, Any]:
    configs = {
        "bt8w1": HashKernelConfig(block_t=8, num_warps=1),
        "bt32w2": HashKernelConfig(block_t=32, num_warps=2),
    }
    from engramrt.bench.registry import Tuning

    spec = Tuning("ngram_hash", ("num_tokens",), match, configs, metric="graph_cold_us")
    results = {name: {"median_us": 99.0, "graph_cold_us": us} for name, us in times.items()}
    results["torch-eager"] = {"median_us": 1.0}  # not a config: never a winner
    return {"status": status, "results": results, "tuning": tuning_record(spec)}


def test_the_fastest_checked_config_is_written(tmp_path: Path) -> None:
    report = {
        "environment": {"gpu": "Test GPU"},
        "cases": [
            _record({"num_tokens": {"max": 1024}}, {"bt8w1": 5.0, "bt32w2": 7.0}),
            _record({}, {"bt8w1": 9.0, "bt32w2": 3.0}),
            _record({"num_tokens": {"max": 16384}}, {"bt8w1": 1.0}, status="failed"),
        ],
    }
    best = best_configs(report)["ngram_hash"]
    assert [(m, name) for m, _, name in best] == [
        ({"num_tokens": {"max": 1024}}, "bt8w1"),
        ({}, "bt32w2"),
    ]
    shipped = kernel_config_for(8192)
    (path,) = write_configs(report, tmp_path)
    assert path.name == "ngram_hash.Test_GPU.json"
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        assert kernel_config_for(256, "Test GPU") == HashKernelConfig(block_t=8, num_warps=1)
        # the failed case's bucket keeps the shipped entry
        assert kernel_config_for(8192, "Test GPU") == shipped
        assert kernel_config_for(2**20, "Test GPU") == HashKernelConfig(block_t=32, num_warps=2)
    tuning.clear_cache()


def test_a_report_without_a_gpu_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="names no GPU"):
        write_configs({"environment": {"device": "cpu"}, "cases": []}, tmp_path)
    assert not list(tmp_path.iterdir())
