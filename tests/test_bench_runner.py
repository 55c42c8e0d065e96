"""The benchmark runner: a wrong implementation is reported as failed, never timed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from engramrt.bench import registry, runner
from engramrt.bench.registry import Case, all_cases
from engramrt.bench.runner import markdown_table, run_case, run_cases
from engramrt.cli import app
from engramrt.errors import ValidationError


def _case(name: str, wrong: bool = False, raises: bool = False) -> Case:
    def make(device: torch.device) -> dict[str, Any]:
        return {"x": torch.arange(1.0, 9.0, device=device)}

    def right(inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["x"] * 2

    def other(inputs: dict[str, Any]) -> torch.Tensor:
        if raises:
            raise RuntimeError("kernel exploded")
        return inputs["x"] * 2 + (1 if wrong else 0)

    def check(inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        for impl, value in outputs.items():
            if not torch.equal(value, outputs["baseline"]):
                raise AssertionError(f"{impl} differs from the baseline")

    return Case(
        name=name,
        params={},
        make=make,
        impls={"fast": other, "baseline": right},
        baseline="baseline",
        check=check,
        bytes_moved=64,
        items=8,
        item_name="values",
        requires_cuda=False,
    )


@pytest.mark.parametrize(
    ("wrong", "raises", "error"), [(True, False, "fast differs"), (False, True, "kernel exploded")]
)
def test_a_failing_case_is_reported_and_not_timed(wrong: bool, raises: bool, error: str) -> None:
    record = run_case(_case("selftest/x", wrong=wrong, raises=raises), torch.device("cpu"), {})
    assert record["status"] == "failed"
    assert error in record["error"]
    assert "results" not in record  # nothing was timed
    table = markdown_table(
        {
            "environment": {"date": "2026-01-01", "device": "cpu", "torch": "t", "triton": "t"},
            "cases": [record],
        }
    )
    assert "| selftest/x | — | failed |" in table


def test_case_patterns_select_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [_case("selftest/a/T=1"), _case("selftest/a/T=2"), _case("selftest/b/T=1")]
    monkeypatch.setattr(registry, "_FACTORIES", [lambda quick: cases])
    assert [c.name for c in all_cases(groups=["selftest"])] == [c.name for c in cases]
    monkeypatch.setattr(
        "engramrt.bench.runner.run_case",
        lambda case, device, ceilings: {"name": case.name, "status": "selected"},
    )
    report = run_cases(["selftest"], device="cpu", names=["selftest/a/*", "*/b/T=1"])
    assert [r["name"] for r in report["cases"]] == [c.name for c in cases]
    report = run_cases(["selftest"], device="cpu", names=["selftest/a/T=2"])
    assert [r["name"] for r in report["cases"]] == ["selftest/a/T=2"]
    with pytest.raises(
        ValidationError, match=r"case patterns \['lookup/\*'\] match no benchmark case"
    ):
        run_cases(["selftest"], device="cpu", names=["lookup/*"])


def test_every_registered_case_has_a_unique_name_and_its_baseline() -> None:
    for quick in (True, False):
        cases = all_cases(quick)
        names = [c.name for c in cases]
        assert len(names) == len(set(names))
        groups = {c.group for c in cases}
        assert {"hash", "gate", "lookup", "quant", "layer", "cache"} <= groups
        for case in cases:
            assert case.baseline in case.impls, case.name
            assert case.name.startswith(case.group + "/"), case.name
            assert set(case.graph_impls or ()) <= set(case.impls), case.name


def test_bench_refuses_cuda_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the error raised on machines without a GPU")
    result = CliRunner().invoke(app, ["bench", "--quick"])
    assert result.exit_code != 0
    assert "no CUDA device is visible; nothing was run" in str(result.exception) + result.output


def test_record_format_with_graph_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph case's record carries graph_us and graph_cold_us, shown in both outputs."""
    case = _case("selftest/graph")
    case.graph, case.graph_impls = True, ("fast",)
    # On CPU the runner times nothing in graphs: no graph key appears.
    record = run_case(case, torch.device("cpu"), {})
    assert record["status"] == "ok"
    for res in record["results"].values():
        assert not {"graph_us", "graph_cold_us", "graph_error"} & set(res)
    # Graph timings as CUDA would report them (20 calls warm; one call, L2 flushed).
    calls: list[str] = []

    def fake_graph_times(fn: Any, inputs: Any, device: torch.device) -> dict[str, float]:
        calls.append(str(device))
        return {"graph_us": 2.5, "graph_cold_us": 7.25}

    monkeypatch.setattr(runner, "_graph_times", fake_graph_times)
    record = run_case(case, torch.device("cpu"), {})
    assert len(calls) == 1  # only the impl listed in graph_impls
    fast, base = record["results"]["fast"], record["results"]["baseline"]
    assert (fast["graph_us"], fast["graph_cold_us"]) == (2.5, 7.25)
    assert "graph_cold_us" not in base
    assert set(fast) >= {"median_us", "eager_wall_us", "items_per_s", "speedup_vs_baseline"}
    # The best time counts the warm graph, never the cold one.
    assert fast["items_per_s"] == pytest.approx(8 / (min(fast["median_us"], 2.5) * 1e-6))
    assert "graph 2.5us graph-cold 7.2us" in runner.format_record(record)
    table = markdown_table(
        {
            "environment": {"date": "2026-01-01", "device": "cpu", "torch": "t", "triton": "t"},
            "cases": [record],
        }
    )
    header = next(line for line in table.splitlines() if line.startswith("| case"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[3:5] == ["graph µs", "graph cold µs"]
    row = next(line for line in table.splitlines() if "| fast |" in line)
    values = [c.strip() for c in row.strip("|").split("|")]
    assert len(values) == len(cells)
    assert values[3:5] == ["2.5", "7.2"]
    base_row = next(line for line in table.splitlines() if "baseline (baseline)" in line)
    assert [c.strip() for c in base_row.strip("|").split("|")][3:5] == ["—", "—"]


def test_median_seconds_times_each_call_with_its_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The median of the timed calls (warm-up calls untimed), each timed to the end of
    its sync, on a clock that the calls themselves advance; a call count below 1 is
    refused by name."""
    import time

    from engramrt.bench.runner import median_seconds

    clock = [0.0]
    calls: list[str] = []
    costs = iter([5.0, 5.0, 30.0, 1.0, 2.0])  # two warm-ups, then three timed calls

    def fn() -> None:
        calls.append("fn")
        clock[0] += next(costs)

    def sync() -> None:
        calls.append("sync")
        clock[0] += 4.0

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    seconds = median_seconds(fn, 3, warmup=2, sync=sync)
    assert calls == ["fn", "fn", "sync"] + ["fn", "sync"] * 3
    # Timed: 34, 5 and 6 (each call's cost and its sync's): the median is 6; the mean
    # would be 15, a timing without the sync 2.
    assert seconds == 6.0
    with pytest.raises(ValueError, match="calls=0"):
        median_seconds(fn, 0)


def test_the_environment_names_the_host_threads_settings(monkeypatch) -> None:
    """A record says how the host's threads ran: the intra-op count, the CPUs, and the
    thread settings that were set (only those: an unset one is absent, not empty)."""
    from engramrt.bench.runner import environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    env = environment(torch.device("cpu"))
    assert env["thread_settings"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "KMP_BLOCKTIME" not in env["thread_settings"]
    assert env["intra_op_threads"] == torch.get_num_threads() and env["cpus"] >= 1
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in environment(torch.device("cpu"))["thread_settings"]
