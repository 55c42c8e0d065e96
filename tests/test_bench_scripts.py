"""The scripts under bench/ that CI can run: the results renderer and the multi-GPU check on gloo."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.spawn import torchrun_bench

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _assert_runner_environment(record: dict, device: str) -> None:
    """A bench script's record says where it ran as ``engramrt bench`` does, under
    ``environment`` (:func:`engramrt.bench.runner.environment`), and nowhere else."""
    env = record["environment"]
    assert env["device"] == device and {"date", "torch", "triton", "python"} <= set(env)
    assert env["intra_op_threads"] >= 1 and env["cpus"] >= 1
    assert isinstance(env["thread_settings"], dict)
    assert not {"date", "torch", "triton", "gpu", "python"} & set(record)


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


def test_benchmarks_md_is_its_rendering(tmp_path) -> None:
    """BENCHMARKS.md's results tables and targets summary are what the renderer writes from
    bench/results and bench/targets.json; each summary row is dated and names a section that
    exists. A hand edit of either part, left unrendered, is caught."""
    import re
    import shutil

    render = _load("render_benchmarks")
    results, benchmarks = ROOT / "bench" / "results", ROOT / "BENCHMARKS.md"
    assert render.main([str(results), str(benchmarks), "--check"]) == 0
    text = benchmarks.read_text()
    summary = text.split(render.TARGETS_START)[1].split(render.TARGETS_END)[0]
    rows = [line for line in summary.strip().splitlines()[2:]]
    targets = json.loads((ROOT / "bench" / "targets.json").read_text())["targets"]
    assert len(rows) == len(targets) >= 10
    headings = {render.slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    for row, target in zip(rows, targets, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        newest = max(m["date"] for m in target["measurements"])
        assert cells[0] == target["what"] and cells[4] == newest, row
        link = re.fullmatch(r"\[(.+)\]\((.*)#([\w-]+)\)", cells[5])
        assert link is not None, row
        if link.group(2) == "":
            assert link.group(3) in headings, row
        else:
            assert f"## {link.group(1)}" in (ROOT / link.group(2)).read_text(), row
    # Stale hand edits, in a copy (with the doc a row cites): one number of the summary, one
    # of the results tables; each is caught by --check and undone by rendering.
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "cache.md", tmp_path / "docs" / "cache.md")
    copy = tmp_path / "BENCHMARKS.md"
    first = rows[0].split(" | ")[2]
    edited = first.replace(re.findall(r"\d+\.\d", first)[0], "1.0", 1)
    for old, new in ((first, edited), ("| 64.9 |", "| 63.9 |")):
        assert text.count(old) == 1, old
        copy.write_text(text.replace(old, new))
        assert render.main([str(results), str(copy), "--check"]) == 1
        assert render.main([str(results), str(copy)]) == 0 and copy.read_text() == text


def test_targets_summary_takes_the_newest_and_checks_its_section() -> None:
    render = _load("render_benchmarks")
    doc = (
        "# B\n\n## Old run (2026-01-01)\n\nhash 9.5 µs\n\n"
        "## New run (2026-01-03)\n\nhash 7.25 µs, gate 12 µs\n\n### Detail\n\ngate 11.5 µs\n"
    )

    def measured(date: str, section: str, result: str) -> dict:
        return {"date": date, "section": section, "result": result, "verdict": "v"}

    old = measured("2026-01-01", "Old run (2026-01-01)", "9.5 µs")
    new = measured("2026-01-03", "New run (2026-01-03)", "7.25 µs")
    detail = measured("2026-01-03", "Detail", "11.5 µs")  # dated by the heading above it
    table = render.targets_table(
        [
            {"what": "hash", "goal": "< 8 µs", "measurements": [new, old]},
            {"what": "gate", "goal": "< 12 µs", "measurements": [new, detail]},
        ],
        {"BENCHMARKS.md": doc},
    )
    assert table.splitlines()[2:] == [
        "| hash | < 8 µs | 7.25 µs | v | 2026-01-03 | [New run (2026-01-03)](#new-run-2026-01-03) |",
        "| gate | < 12 µs | 11.5 µs | v | 2026-01-03 | [Detail](#detail) |",  # same date: the last
    ]
    for wrong, error in (
        (measured("2026-01-03", "New run (2026-01-03)", "7.3 µs"), r"does not hold \['7.3'\]"),
        # Part of a number of the section is not that number: 7.2 or 25 of its 7.25.
        (measured("2026-01-03", "New run (2026-01-03)", "7.2 µs"), r"does not hold \['7.2'\]"),
        (measured("2026-01-03", "New run (2026-01-03)", "25 µs"), r"does not hold \['25'\]"),
        (measured("2026-01-02", "New run (2026-01-03)", "7.25 µs"), "does not hold the date"),
        (measured("2026-01-03", "Newer run", "7.25 µs"), "0 headings 'Newer run'"),
    ):
        with pytest.raises(ValueError, match=error):
            render.targets_table(
                [{"what": "hash", "goal": "-", "measurements": [old, wrong]}],
                {"BENCHMARKS.md": doc},
            )


def _script_process(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` with this checkout's package, run to its end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=300
    )


def _run_script(script: Path, *args: str) -> str:
    """``python SCRIPT ARGS`` with this checkout's package; its stdout, or a failure."""
    done = _script_process(script, *args)
    if done.returncode != 0:
        pytest.fail(f"{script.name} {args} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def test_cache_hit_study_writes_docs_only_when_told(tmp_path) -> None:
    """``bench/cache_hit_study.py`` (run from a copy, so its docs/cache.md is a scratch file)
    prints its table and leaves the docs alone; ``--write-docs`` replaces the marked table,
    from a run or from ``--render`` of a recorded JSON."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "docs").mkdir()
    script = tmp_path / "bench" / "cache_hit_study.py"
    script.write_bytes((ROOT / "bench" / "cache_hit_study.py").read_bytes())
    docs = tmp_path / "docs" / "cache.md"
    before = "# Cache\n\n<!-- hit-study:begin -->\nthe table\n<!-- hit-study:end -->\ntail\n"
    docs.write_text(before)
    out = tmp_path / "study.json"
    quick = ["--max-tokens", "20000", "--fractions", "0.001", "--uniform-fractions", "0.001"]
    quick += ["--frozen-fractions", "0.001"]
    printed = _run_script(script, *quick, "--threads", "1", "--out", str(out))
    assert docs.read_text() == before  # the default: no docs written
    record = json.loads(out.read_text())
    assert "| natural | 0.1% |" in printed and record["runs"]["natural"]
    assert "| natural | 0.1%, frozen |" in printed
    # A frozen cache hits only rows an earlier step used: never above the unbounded cache.
    (frozen,) = record["runs"]["frozen"]
    unbounded = record["unbounded"]["natural"]["warm"]["all"]
    assert 0 < frozen["warm"]["all"]["hit_rate"] <= unbounded["hit_rate"]
    _assert_runner_environment(record, "cpu")
    printed = _run_script(script, "--render", str(out))
    assert docs.read_text() == before and "| natural | 0.1% |" in printed
    _run_script(script, "--render", str(out), "--write-docs")
    written = docs.read_text()
    assert written.startswith("# Cache\n\n<!-- hit-study:begin -->\nCorpus: ")
    assert f"Generated {record['environment']['date'][:10]} by" in written
    assert "| natural | 0.1% |" in written and written.endswith("<!-- hit-study:end -->\ntail\n")
    recorded = ROOT / "bench" / "results" / "cache-hit-study-20261208.json"  # docs/cache.md's run
    table = _run_script(script, "--render", str(recorded))
    assert "| natural | 5% | 19,200,304 |" in table and "| natural | 5%, frozen |" in table
    assert table.split("\n", 1)[1] in (ROOT / "docs" / "cache.md").read_text()
    earlier = ROOT / "bench" / "results" / "cache-hit-study-20261129.json"  # before frozen caches
    assert "frozen" not in _run_script(script, "--render", str(earlier)).split("|", 1)[1]


def test_cache_hit_study_refuses_fractions_outside_the_table() -> None:
    for flag in ("--fractions", "--frozen-fractions"):
        done = _script_process(ROOT / "bench" / "cache_hit_study.py", flag, "0.05", "0")
        assert done.returncode == 2, done.stderr
        assert f"{flag} holds [0.0]; expected fractions in (0, 1]" in done.stderr


def test_cache_hit_study_frozen_caches_hit_only_what_their_profile_held() -> None:
    """Steps 0-1 (the profile) use rows 1 and 2, steps 2-3 rows 1 and 3: the frozen cache
    hits row 1 in both later steps and never row 3, which an updating cache (the
    control) admits after step 2 and hits in step 3."""
    import torch

    study = _load("cache_hit_study")
    ids = torch.tensor([[1, 2], [1, 2], [1, 3], [1, 3]], dtype=torch.int64)
    stream = study.Stream(ids, 1, torch.tensor([0, 0]))
    frozen = study.simulate_frozen(stream, 64, n_heads=1)
    assert frozen["rows_held"] == 2
    assert frozen["warm"]["all"]["hits"] == 2 and frozen["warm"]["all"]["lookups"] == 4
    updating = study.simulate(stream, 64, n_heads=1)
    assert updating["warm"]["all"]["hits"] == 3


def test_multi_gpu_script_on_gloo(tmp_path) -> None:
    """Two gloo processes: TP, sequence-parallel, all-to-all, a shared host table and the layer
    equal one process; the shared table is loaded once and removed afterwards."""
    out = tmp_path / "report.json"
    done = torchrun_bench(
        "multi_gpu.py",
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
    )
    if done.returncode != 0:
        pytest.fail(
            f"multi_gpu.py exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and report["backend"] == "gloo" and report["failures"] == []
    _assert_runner_environment(report, "cpu")
    assert report["environment"]["devices"] == ["cpu", "cpu"]
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
    from engramrt.lookup.tiers import TablePlacement
    from engramrt.runtime import synthetic_stores

    layout = EngramLayout(scaled_config(table_gib))
    (store,) = synthetic_stores(layout, TablePlacement("device", "cpu"), seed=1)[:1]
    ids = random_ids(layout, num_tokens, seed=seed)
    rows = lookup_rows_reference(ids, store.table, layout.config.head_dim)
    return hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()


# --- bench/runtime_overhead.py: the parts that run without a GPU ----------------------


def test_runtime_bench_engram_blocks() -> None:
    bench = _load("runtime_overhead")
    assert bench.parse_engram_at("1,14") == {1: 0, 14: 1}  # V4.1-Flash's engram_layer_ids
    assert bench.parse_engram_at("0,29") == {0: 0, 29: 1}
    for bad in ("14,1", "1", "1,30", "-1,3"):
        with pytest.raises(SystemExit, match="--engram-at"):
            bench.parse_engram_at(bad)


@pytest.fixture(scope="module")
def tiny_hashing(token_map):
    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants, NgramHasher

    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    return consts, NgramHasher(consts, token_map, "cpu", backend="reference")


def test_runtime_bench_decode_streams_hash_like_one_shot(tiny_hashing, token_map) -> None:
    """Every decode step built from text or Zipf streams hashes, through the hasher, to the
    one-shot row ids of each request's stream at that position."""
    import numpy as np

    from engramrt.hashing import hash_sequence

    bench = _load("runtime_overhead")
    consts, hasher = tiny_hashing
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, token_map.vocab_size, n) for n in (40, 7, 55, 31)]
    text = bench.text_streams(docs, 5, 12)
    assert text.shape == (5, 12)
    np.testing.assert_array_equal(text[1], np.concatenate(docs)[26:38])  # 133 // 5 per slice
    zipf = bench.zipf_streams(rng, token_map.vocab_size, 5, 12)
    assert zipf.shape == (5, 12) and zipf.min() >= 0 and zipf.max() < token_map.vocab_size
    for streams in (text, zipf):
        batches = bench.decode_batches_from(streams, "cpu")
        assert len(batches) == 12 - 3
        want = np.stack([hash_sequence(token_map.compress(s), consts) for s in streams])
        for t, batch in enumerate(batches):
            got = hasher(batch).numpy()
            np.testing.assert_array_equal(got, want[:, 3 + t])
        # Negative control: lookback ids one position off hash differently.
        shifted = bench.decode_batches_from(streams, "cpu")[1]
        shifted.lookback_token_ids = batches[0].lookback_token_ids
        assert not np.array_equal(hasher(shifted).numpy(), want[:, 4])
    with pytest.raises(SystemExit, match="need more"):
        bench.text_streams(docs, 5, 40)


def test_runtime_bench_zipf_ids_are_skewed() -> None:
    import numpy as np

    bench = _load("runtime_overhead")
    ids = bench.zipf_streams(np.random.default_rng(0), 129_280, 256, 103)
    counts = np.sort(np.bincount(ids.ravel()))[::-1]
    # Zipf(1.2): the top id alone is about 1 / zeta(1.2) = 18% of the draws; uniform
    # ids over 129,280 would repeat about once in all 26,368.
    assert counts[0] > 0.1 * ids.size
    assert len(np.unique(ids)) < ids.size / 2


def test_runtime_bench_engine_style_rows(token_map) -> None:
    """The engine-style baseline's rows: hashing, then every layer's lookup on the current
    stream; equal to the runtime's rows and to the reference lookup."""
    import numpy as np
    import torch

    from engramrt.config import PRESETS
    from engramrt.hashing import HashBatch, HashConstants, NgramHasher
    from engramrt.layout import EngramLayout
    from engramrt.lookup import lookup_rows_reference
    from engramrt.lookup.tiers import TablePlacement
    from engramrt.runtime import EngramRuntime, synthetic_stores

    bench = _load("runtime_overhead")
    cfg = PRESETS["tiny"]
    layout = EngramLayout(cfg)
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    stores = synthetic_stores(layout, TablePlacement("device", "cpu"), seed=2)
    engine = bench.EngineStyle(NgramHasher(consts, token_map, "cpu"), stores, max_tokens=64)
    runtime = EngramRuntime(
        NgramHasher(consts, token_map, "cpu"), stores, max_tokens=64, max_requests=8
    )
    rng = np.random.default_rng(5)
    for length, start in ((23, 0), (9, 23)):
        batch = HashBatch.single(rng.integers(0, token_map.vocab_size, length), start=start)
        got, want = engine.plan(batch), runtime.plan(batch)
        assert got.num_tokens == length
        for li, store in enumerate(stores):
            rows = got.rows(li)
            assert rows.shape == (length, cfg.n_cols, cfg.head_dim)
            assert torch.equal(rows.view(torch.int16), want.rows(li).view(torch.int16))
            ref = lookup_rows_reference(want.row_ids[:, li], store.table, cfg.head_dim)
            assert torch.equal(rows.view(torch.int16), ref.view(torch.int16))
    assert engine.plan(batch).slot != got.slot  # two staging slots, alternating
    runtime.close()


def test_runtime_bench_grid_settings_per_layer() -> None:
    bench = _load("runtime_overhead")
    assert bench.parse_programs("default") is None
    assert bench.parse_programs("16:32") == (16, 32)
    assert bench.parse_programs("0") == (None, None)
    both = bench.parse_programs("0/16:64")
    assert both == ((None, None), (16, 64))
    assert [bench.layer_grid(both, li) for li in range(2)] == [(None, None), (16, 64)]
    assert [bench.layer_grid((16, 32), li) for li in range(2)] == [(16, 32), (16, 32)]


_ONE_DECODE_STEP = (
    "--decode-steps", "2", "--block-steps", "1", "--warmup-steps", "0", "--workloads", "decode",
)  # fmt: skip
"""Options of a smoke run that times one decode step per block."""


def _runtime_smoke(tmp_path, *extra: str, bench=None) -> dict:
    bench = bench or _load("runtime_overhead")
    out = tmp_path / "runtime.json"
    bench.main(
        [
            "--smoke",
            "--device",
            "cpu",
            "--table-gib",
            "0.001",
            "--backbones",
            "eager",
            "--out",
            str(out),
            *extra,
        ]
    )
    return json.loads(out.read_text())


def test_runtime_bench_smoke_on_cpu(tmp_path) -> None:
    """The whole script on a CPU with a tiny backbone: every placement runs, and the report
    gives each against GPU-memory tables and against the engine-style baseline."""
    report = _runtime_smoke(
        tmp_path,
        "--decode-steps",
        "3",
        "--block-steps",
        "2",
        "--warmup-steps",
        "1",
        "--workloads",
        "decode",
        "--ids",
        "zipf",
        "--tiers",
        "device,host-cache,engine-uva",
        "--rounds",
        "1",
        "--lookup-workers",
        "per-layer,shared",
        "--cache-update-every",
        "2",
    )
    assert report["engram_at_blocks"] == [1, 14] and report["smoke"] is True
    _assert_runner_environment(report, "cpu")
    assert report["cache_update_every"] == 2
    assert report["rounds_completed"] == 1
    results = report["results"]
    shared = "host-cache priority=0 workers=shared"
    placements = {"device", "host-cache", shared, "engine-uva"}
    assert {r["placement"] for r in results} == placements
    assert len(results) == 4 * 2  # each placement with and without prefetch
    for r in results:
        assert r["workload"] == "decode 256x1 zipf" and r["tokens_per_step"] == 256
        assert r["steps_per_block"] == 2 and len(r["ms_per_step_rounds"]) == 1
        assert "loss_vs_gpu_pct" in r and "gain_vs_engine_uva_pct" in r
    for r in results:
        if r["tier"] == "host-cache":
            workers = "shared" if r["placement"] == shared else "per-layer"
            assert r["lookup_workers"] == workers and r["lookup_priority"] == 0
            assert len(r["cache_hit_rate"]) == 2
            assert all(0.0 <= rate <= 1.0 for rate in r["cache_hit_rate"])
        else:
            assert "cache_hit_rate" not in r


def test_runtime_bench_cache_placements(device) -> None:
    """The cached placements: each layer's host table behind a cache, run on the lookup
    workers; ``host-mixed-cache`` keeps the default's split (on a GPU the probe reads
    layer 0's misses, and the CPU gathers layer 1's: its backing reads no rows with the
    GPU), ``host-cache-torch`` runs the policy's torch definition."""
    from engramrt.cache import CachedRowStore
    from engramrt.layout import EngramLayout

    bench = _load("runtime_overhead")
    cfg = bench.scaled_config(0.001)
    layout = EngramLayout(cfg)
    cuda = device.type == "cuda"
    backend = {} if cuda else {"backend": "reference"}
    for tier in bench.CACHE_TIERS:
        assert len(bench.tier_variants(tier, [0], ["per-layer", "shared"])) == 2
        stores = bench.build_stores(tier, cfg, layout, device, bench.CacheSettings(), backend)
        assert all(isinstance(store, CachedRowStore) for store in stores)
        reads = [store.probe_reads_misses for store in stores]
        assert reads == ([cuda, False] if tier == "host-mixed-cache" else [cuda, cuda]), tier
        torch_policy = tier == "host-cache-torch" or not cuda
        assert all(store.policy.uses_kernels is not torch_policy for store in stores), tier


def test_runtime_bench_rounds_report(tmp_path) -> None:
    """Three rounds of decode and prefill blocks (prefill in the first two only): per-round
    lists, quartiles of the paired losses, the A/A control, no stalls on a CPU."""
    report = _runtime_smoke(
        tmp_path,
        "--decode-steps",
        "4",
        "--block-steps",
        "2",
        "--warmup-steps",
        "0",
        "--prefill-chunks",
        "1",
        "--prefill-rounds",
        "2",
        "--ids",
        "random",
        "--tiers",
        "none,device,device-again",
        "--rounds",
        "3",
        "--seed",
        "7",
    )
    assert report["rounds_completed"] == 3 and report["order_seed"] == 7
    results = report["results"]
    assert {r["placement"] for r in results} == {"none", "device", "device-again"}
    assert len(results) == 3 * 2 * 2  # placements x workloads x prefetch
    for r in results:
        decode = r["workload"].startswith("decode")
        rounds = r["ms_per_step_rounds"]
        assert len(rounds) == 3 and r["rounds"] == (3 if decode else 2)
        assert (rounds[2] is None) is not decode  # prefill runs in the first two rounds only
        assert r["stall_us"] is None and r["stall_pct_of_step"] is None
        assert "interference_pct" not in r
        for name in ("loss_vs_gpu_pct", "loss_vs_no_lookups_pct"):
            assert r[f"{name}_p25"] <= r[name] <= r[f"{name}_p75"]
            per_round = r[f"{name}_rounds"]
            assert [v is None for v in per_round] == [v is None for v in rounds]
        if r["placement"] == "device":  # against itself: exactly zero every round
            assert all(v in (None, 0.0) for v in r["loss_vs_gpu_pct_rounds"])
    again = [r for r in results if r["placement"] == "device-again"]
    assert len(again) == 4 and all(r["tier"] == "device-again" for r in again)
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, replaced


def test_runtime_bench_host_inline_reads_on_the_step_stream(tmp_path) -> None:
    """``host-inline`` shares host-mixed's tables and runs its lookups inside plan."""
    report = _runtime_smoke(
        tmp_path,
        *_ONE_DECODE_STEP,
        "--tiers",
        "device,host-mixed,host-inline",
        "--rounds",
        "1",
    )
    overlap = {r["placement"]: r["lookup_overlap"] for r in report["results"]}
    assert overlap == {"device": "side", "host-mixed": "side", "host-inline": "none"}


def test_runtime_bench_max_seconds_stops_new_rounds(tmp_path) -> None:
    report = _runtime_smoke(
        tmp_path,
        *_ONE_DECODE_STEP,
        "--tiers",
        "device,device-again",
        "--rounds",
        "3",
        "--max-seconds",
        "0",
    )
    assert report["rounds"] == 3 and report["rounds_completed"] == 1
    assert [len(r["ms_per_step_rounds"]) for r in report["results"]] == [1] * 4


def test_runtime_bench_block_window() -> None:
    bench = _load("runtime_overhead")
    assert bench.block_window(10, 0, 3) == ([], [0, 1, 2])
    assert bench.block_window(10, 1, 3, warmup=2) == ([1, 2], [3, 4, 5])
    assert bench.block_window(10, 3, 3, warmup=1) == ([8], [9, 0, 1])  # wraps
    assert bench.block_window(10, 0, 3, warmup=2) == ([8, 9], [0, 1, 2])
    # Successive rounds time disjoint steps until the batches run out.
    windows = [set(bench.block_window(300, r, 20)[1]) for r in range(15)]
    assert len(set().union(*windows)) == 300
    assert bench.block_window(5, 0, 7)[1] == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="steps=0"):
        bench.block_window(10, 0, 0)
    with pytest.raises(ValueError, match="num_batches=0"):
        bench.block_window(0, 0, 3)


def test_runtime_bench_paired_stats_cancel_drift() -> None:
    """A placement 1% slower than the device tables while the clock drifts between rounds:
    the paired loss is 1%; a loss from each placement's own median over rounds is not."""
    import numpy as np

    bench = _load("runtime_overhead")
    drift = [5.66, 6.08, 5.80, 5.70, 6.00]  # the device tables' ms/step, round by round
    config = [1.01 * d for d in drift]
    stats = bench.paired_stats("loss", config, drift)
    want = 100 * (1 - 1 / 1.01)
    np.testing.assert_allclose(stats["loss_rounds"], [want] * 5, rtol=1e-12)
    assert stats["loss"] == pytest.approx(want, rel=1e-12)
    assert stats["loss_p25"] == pytest.approx(want) and stats["loss_p75"] == pytest.approx(want)
    # The clock drifts by 20% over the rounds and each round's ratio carries +-2% of noise
    # whose median is the 1%: the paired median is the median of the rounds' losses; the
    # medians of each side fall in different rounds (2 for the device, 1 for the placement).
    drift = [5.00, 5.02, 5.04, 6.00, 6.10]
    factors = [1.03, 1.03, 0.99, 1.01, 1.01]
    noisy = [d * f for d, f in zip(drift, factors, strict=True)]
    stats = bench.paired_stats("loss", noisy, drift)
    losses = sorted(100 * (1 - 1 / f) for f in factors)
    assert stats["loss"] == pytest.approx(want, rel=1e-12) == pytest.approx(losses[2])
    assert stats["loss_p25"] == pytest.approx(losses[1])
    assert stats["loss_p75"] == pytest.approx(losses[3])
    # Negative control: the unpaired estimate is off by more than the 1% it measures.
    unpaired = 100 * (1 - np.median(drift) / np.median(noisy))
    assert abs(unpaired - want) > 1.0
    # A gain, unpaired rounds (None) skipped, and rounds that must line up.
    gain = bench.paired_stats("gain", [5.0, None, 4.0], [5.5, 6.0, None], gain=True)
    assert gain["gain_rounds"] == [pytest.approx(10.0), None, None]
    assert gain["gain"] == gain["gain_p25"] == gain["gain_p75"] == pytest.approx(10.0)
    empty = bench.paired_stats("loss", [None], [1.0])
    assert empty["loss"] is None and empty["loss_rounds"] == [None]
    with pytest.raises(ValueError, match="config_ms has 2 rounds"):
        bench.paired_stats("loss", [1.0, 2.0], [1.0])


def test_runtime_bench_stall_events_bracket_each_wait(monkeypatch) -> None:
    """The eager backbone records an event pair around each layer's ``rows`` call, per step,
    and the stalls read back are the time inside those calls only (a fake event clock: CUDA
    events need a GPU)."""
    from types import SimpleNamespace

    import torch

    bench = _load("runtime_overhead")
    clock = [0.0]  # ms

    class ClockEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.ms: float | None = None

        def record(self) -> None:
            self.ms = clock[0]

        def elapsed_time(self, end: ClockEvent) -> float:
            assert self.ms is not None and end.ms is not None
            return end.ms - self.ms

    class Handle:
        def __init__(self, step: int) -> None:
            self.step, self.slot = step, 0

        def rows(self, layer_index: int):
            clock[0] += 1e-3 * (10 * self.step + layer_index + 1)  # the wait: a few us
            return torch.zeros(2, 1, 1, dtype=torch.bfloat16)

    class Runtime:
        def plan(self, batch) -> Handle:
            return Handle(batch.index)

        prefetch = plan

    def head(hidden, rows):
        clock[0] += 1.0  # the Engram layer's own work: outside the bracket
        return hidden

    monkeypatch.setattr(torch.cuda, "Event", ClockEvent)
    monkeypatch.setattr(bench, "D", 8)
    monkeypatch.setattr(bench, "FFN", 16)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    blocks = [(w(8, 24), w(8, 8), w(8, 32), w(16, 8)) for _ in range(16)]
    forward = bench.eager_forward((blocks, [head, head]), "cpu")
    batches = [SimpleNamespace(index=i, num_tokens=2, input_ids=torch.zeros(2)) for i in range(3)]
    for prefetch in (False, True):
        clock[0] = -5.0
        stalls = bench.StallEvents(4)  # preallocated for more steps than the block's
        assert all(e.ms == -5.0 for step in stalls.events for pair in step for e in pair)
        bench.run(Runtime(), batches, forward, prefetch, stalls)
        got = stalls.stall_us(3)
        # Each wait alone, in us; a bracket around the Engram layer would add 1,000 us.
        want = [[10.0 * s + li + 1 for s in range(3)] for li in range(2)]
        assert [pytest.approx(layer, abs=1e-6) for layer in want] == got
        assert stalls.events[3][0][0].ms == -5.0  # the spare step was not recorded again


def test_runtime_bench_host_ids_hash_on_the_host(tmp_path, monkeypatch) -> None:
    """``host-ids`` plans every step with its host copy (both layers hashed on the host),
    and ``--sync-steps`` makes the host wait for each step (every placement)."""
    from engramrt.hashing import NgramHasher

    hashed: list[tuple[str, tuple[int, ...]]] = []
    real = NgramHasher.hash_on_host

    def counted(self, batch, layers=None):
        hashed.append((batch.device.type, tuple(layers)))
        return real(self, batch, layers)

    monkeypatch.setattr(NgramHasher, "hash_on_host", counted)
    synced: list[object] = []
    bench = _load("runtime_overhead")
    monkeypatch.setattr(bench, "synchronize", lambda device: synced.append(device))
    report = _runtime_smoke(
        tmp_path,
        "--decode-steps",
        "3",
        "--block-steps",
        "2",
        "--warmup-steps",
        "0",
        "--workloads",
        "decode",
        "--tiers",
        "device,host-ids",
        "--rounds",
        "1",
        "--sync-steps",
        bench=bench,
    )
    assert report["sync_steps"] is True
    assert {r["placement"] for r in report["results"]} == {"device", "host-ids"}
    # host-ids' 2 blocks (with and without prefetch) of 2 steps each hash both layers.
    assert hashed == [("cpu", (0, 1))] * 4
    # 4 blocks: a synchronize before and after each, and one between its 2 steps.
    assert len(synced) == 4 * 3


def test_runtime_bench_model_priorities_pair_within_each(tmp_path) -> None:
    """``--model-priority 0,-1`` times every configuration at both priorities, each paired
    with the references at its own priority."""
    report = _runtime_smoke(
        tmp_path,
        *_ONE_DECODE_STEP,
        "--tiers",
        "device,device-again",
        "--rounds",
        "2",
        "--model-priority",
        "0,-1",
    )
    assert report["model_priority"] == [0, -1]
    with pytest.raises(SystemExit, match=r"--model-priority: '0,high'; expected comma-separated"):
        _load("runtime_overhead").parse_priorities("0,high")
    results = report["results"]
    assert sorted((r["placement"], r["model_priority"], r["prefetch"]) for r in results) == [
        (p, q, f) for p in ("device", "device-again") for q in (-1, 0) for f in (False, True)
    ]
    for r in results:
        if r["placement"] == "device":  # paired with itself at its own priority: zero
            assert all(v == 0.0 for v in r["loss_vs_gpu_pct_rounds"])


def test_plan_host_time_runs_on_cpu(tmp_path) -> None:
    """``bench/plan_host_time.py`` end to end on a CPU: both placements timed and profiled,
    the report written atomically."""
    bench = _load("plan_host_time")
    out = tmp_path / "plan.json"
    report = bench.main(
        [
            "--device", "cpu", "--table-gib", "0.001", "--calls", "2", "--warmup", "0",
            "--profile-calls", "1", "--steps", "2", "--out", str(out),
        ]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    _assert_runner_environment(report, "cpu")
    assert [r["tier"] for r in report["results"]] == ["device", "host"]
    for r in report["results"]:
        assert r["lookup_workers"] == "shared"
        assert 0 < r["plan_us"]["p25"] <= r["plan_us"]["median"] <= r["plan_us"]["p75"]
        assert r["step_us"]["median"] >= r["plan_us"]["median"]  # each step holds its plan
        assert r["profile"] and all(p["own_us_per_plan"] >= 0 for p in r["profile"])
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit, match="--tiers: 'uva'"):
        bench.parse_args(["--tiers", "uva"])
    unprofiled = bench.main(
        ["--device", "cpu", "--table-gib", "0.001", "--calls", "1", "--warmup", "0",
         "--profile-calls", "0", "--steps", "1", "--tiers", "device"]
    )  # fmt: skip
    assert unprofiled["results"][0]["profile"] == []  # timing alone, no profile


def test_profile_cache_update_runs_on_cpu(tmp_path) -> None:
    """``bench/profile_cache_update.py`` end to end on a CPU: every lookup and update is a
    profiler range of its own, counted per call; the report written atomically."""
    bench = _load("profile_cache_update")
    out = tmp_path / "cache.json"
    report = bench.main(
        ["--device", "cpu", "--table-gib", "0.001", "--steps", "3", "--warmup", "1",
         "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["lookup"]["calls"] == 3 and report["update"]["calls"] == 3
    assert report["lookup"]["kernels"] > 0 and report["update"]["kernels"] > 0
    assert 0.0 <= report["hit_rate"] <= 1.0 and report["lookup_to_rows_us"] is None
    assert report["policy"] == "kernels"
    assert report["device"]["kernels_per_step"] == 0  # no device in the trace on a CPU
    _assert_runner_environment(report, "cpu")
    assert not list(tmp_path.glob("*.tmp"))
    torch_policy = bench.main(
        ["--device", "cpu", "--table-gib", "0.001", "--steps", "2", "--warmup", "1",
         "--policy", "torch"]
    )  # fmt: skip
    assert torch_policy["policy"] == "torch" and torch_policy["update"]["calls"] == 2
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--policy", "numpy"])


@pytest.mark.parametrize("scope", ["config", "placement"])
def test_runtime_bench_cache_scope(scope) -> None:
    """``--cache-scope config``: each (id kind, prefetch) runs through caches of its own, in
    front of the one set of host tables (a round's configurations time the same steps: a
    shared cache would see them twice); ``placement``: one cache for every configuration."""
    bench = _load("runtime_overhead")
    argv = "--smoke --device cpu --table-gib 0.001 --backbones eager --decode-steps 2"
    argv += f" --workloads decode --ids random,zipf --tiers device,host-cache --cache-scope {scope}"
    built = bench.build(bench.parse_args(argv.split()))

    def runs(setup) -> set:
        return {
            (c.workload, c.backbone, c.prefetch)
            for c in built.configs
            if built.setups[c.setup] is setup
        }

    cached = [s for s in built.setups if s.tier == "host-cache"]
    (device,) = [s for s in built.setups if s.tier == "device"]
    every = runs(device)
    assert len(every) == 4  # two id kinds, with and without prefetch
    if scope == "placement":
        assert len(cached) == 1 and runs(cached[0]) == every
        return
    assert sorted(len(runs(s)) for s in cached) == [1, 1, 1, 1]
    assert set().union(*(runs(s) for s in cached)) == every
    for li in range(2):
        stores = [s.stores[li] for s in cached]
        assert len({id(store) for store in stores}) == 4
        assert len({id(store.backing) for store in stores}) == 1


def test_runtime_bench_warms_each_cache_first(tmp_path, capsys) -> None:
    """``--cache-warm-steps``: each cache runs that many steps of other requests' ids of
    the same kind before the rounds (the timed blocks' counters start after them)."""
    report = _runtime_smoke(
        tmp_path,
        *_ONE_DECODE_STEP,
        *["--ids", "zipf", "--tiers", "device,host-cache", "--rounds", "1"],
        *["--cache-warm-steps", "4"],
    )
    warmed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warmed")]
    assert len(warmed) == 2  # with and without prefetch: a cache each
    assert all("4 steps" in line for line in warmed)
    assert report["cache_warm_steps"] == 4
    (cached,) = [r for r in report["results"] if r["tier"] == "host-cache" and not r["prefetch"]]
    assert all(0.0 <= rate <= 1.0 for rate in cached["cache_hit_rate"])
    bench = _load("runtime_overhead")
    with pytest.raises(SystemExit, match="--cache-warm-steps=-1; expected >= 0"):
        bench.parse_args(["--cache-warm-steps", "-1"])
    with pytest.raises(SystemExit):  # argparse names the choices
        bench.parse_args(["--cache-scope", "workload"])


def test_runtime_bench_warm_ids_follow_the_timed_law() -> None:
    """The warm-up's Zipf ids are other draws of the timed ids' law (the same ranking of
    the vocabulary: the same hot ids), not the same draws; its text is other text."""
    import numpy as np
    import torch

    bench = _load("runtime_overhead")
    argv = ["--workloads", "decode", "--ids", "zipf,text", "--decode-steps", "40"]
    args = bench.parse_args([*argv, "--cache-warm-steps", "40"])
    timed = bench.build_workloads(args, 129_280, "cpu")
    warm = bench.build_workloads(args, 129_280, "cpu", warm=True)
    for name in timed:
        a = torch.stack([batch.input_ids for batch in timed[name]]).numpy().ravel()
        b = torch.stack([batch.input_ids for batch in warm[name]]).numpy().ravel()
        assert not np.array_equal(a, b), name
        if name.endswith("zipf"):
            top = [np.argsort(np.bincount(x, minlength=129_280))[::-1][:3] for x in (a, b)]
            np.testing.assert_array_equal(top[0], top[1])


def test_step_cost_pairs_each_case_with_the_gpu_tables_of_its_round(tmp_path, monkeypatch) -> None:
    """bench/step_cost.py on a CPU (--smoke: eager only): every case is checked before it is
    timed, and each cost is the per-round pairing with the GPU-memory placement of the same
    mode, workload, loop and ids, recomputed here from the raw per-round times. The plumbing
    runs on the references (the kernels' own tests cover them under the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    step_cost = _load("step_cost")
    out = tmp_path / "step-cost.json"
    report = step_cost.main(
        ["--smoke", "--table-gib", "0.001", "--rounds", "2", "--steps", "1", "--warmup-steps",
         "0", "--placements", "aa,queued,deferred", "--loops", "sync,queued", "--profile-steps",
         "1",
         "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == report
    _assert_runner_environment(report, "cpu")
    assert sorted(report["profiles"]) == [
        f"{p}/eager/decode/sync/random" for p in ("aa", "deferred", "device", "queued")
    ]
    for profile in report["profiles"].values():
        assert profile["steps"] == 1 and profile["ms_per_step_profiled"] > 0
        assert any(op["name"] == "aten::mm" for op in profile["host"])  # the blocks' matmuls
    cases = report["cases"]
    assert {(c["placement"], c["loop"]) for c in cases} == {
        (p, loop) for p in ("device", "aa", "queued", "deferred") for loop in ("sync", "queued")
    }
    by = {(c["placement"], c["loop"]): c for c in cases}
    for case in cases:
        assert case["mode"] == "eager" and case["workload"] == "decode" and case["ids"] == "random"
        assert case["table_gib"] == 0.001 and case["check"]["passed"]
        if case["placement"] == "device":
            continue
        ref = by[("device", case["loop"])]
        expected = [
            100 * (1 - r / m) for m, r in zip(case["ms_rounds"], ref["ms_rounds"], strict=True)
        ]
        assert case["pct_rounds"] == pytest.approx(expected)
        assert case["rounds"] == 2
        assert case["median_pct"] == pytest.approx(sum(expected) / 2)  # median of two
        assert case["p25_pct"] <= case["median_pct"] <= case["p75_pct"]
        assert case["ref_ms"] == pytest.approx(sum(ref["ms_rounds"]) / 2)


def test_step_cost_deferred_placements_differ_in_gather_threads_only() -> None:
    """``deferred``, ``deferred-4`` and ``deferred-16``: all defer their lookups to the layer;
    the last two's stores gather on 4 and 16 CPU threads, the first's take the store's own
    count. Control: a placement that is not deferred keeps its lookups beside the blocks."""
    import torch

    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    step_cost = _load("step_cost")
    placements = step_cost.PLACEMENTS
    deferred = placements["deferred"].runtime_options()
    assert deferred == placements["deferred-4"].runtime_options()
    assert deferred == placements["deferred-16"].runtime_options()
    assert deferred["lookup_overlap"] == "deferred"
    assert placements["default"].runtime_options()["lookup_overlap"] == "side"
    layout = EngramLayout(PRESETS["tiny"])
    for name, want in (("deferred", None), ("deferred-4", 4), ("deferred-16", 16)):
        stores = step_cost.host_stores(layout, torch.device("cpu"), placements[name], None)
        assert [s.num_threads for s in stores] == [want] * len(stores), name


def test_step_cost_cpu_only_placements_gather_in_stream_order_on_their_threads() -> None:
    """``queued-cpu``, ``queued-cpu-6`` and ``queued-cpu-16``: gathers queued in stream order,
    no GPU reads, the last two on 6 and 16 CPU threads (the first on the store's own count).
    Control: ``queued`` keeps the GPU's reads and the store's thread count."""
    import torch

    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    step_cost = _load("step_cost")
    layout = EngramLayout(PRESETS["tiny"])
    for name, threads in (("queued-cpu", None), ("queued-cpu-6", 6), ("queued-cpu-16", 16)):
        placement = step_cost.PLACEMENTS[name]
        assert placement.cpu_only and placement.gather == "queued"
        assert placement.runtime_options()["gpu_reads"] == "sources"
        assert placement.gather_threads == threads
        stores = step_cost.host_stores(layout, torch.device("cpu"), placement, None)
        assert [s.num_threads for s in stores] == [threads] * len(stores), name
    queued = step_cost.PLACEMENTS["queued"]
    assert not queued.cpu_only and queued.gather_threads is None
    assert "gpu_reads" not in queued.runtime_options()


def test_step_cost_pinned_placement_keeps_lookups_off_the_launching_cpu() -> None:
    """``thread-cpu-pinned``: ``thread-cpu`` with the lookups on every CPU but the first,
    the launching thread on the first while its case runs and on its own CPUs again after.
    Control: ``thread-cpu`` sets no CPUs and leaves the launching thread where it is."""
    step_cost = _load("step_cost")
    pinned, free = step_cost.PLACEMENTS["thread-cpu-pinned"], step_cost.PLACEMENTS["thread-cpu"]
    allowed = os.sched_getaffinity(0)
    first = {min(allowed)}
    assert pinned.runtime_options() == {
        **free.runtime_options(),
        "lookup_cpus": sorted(allowed - first or allowed),
    }
    assert "lookup_cpus" not in free.runtime_options()
    assert pinned.host_options(8) == free.host_options(8)
    with step_cost.launching_cpus(pinned):
        assert os.sched_getaffinity(0) == first
    assert os.sched_getaffinity(0) == allowed
    with step_cost.launching_cpus(free):
        assert os.sched_getaffinity(0) == allowed
    with pytest.raises(RuntimeError, match="inside"), step_cost.launching_cpus(pinned):
        raise RuntimeError("inside")
    assert os.sched_getaffinity(0) == allowed


def test_step_cost_runs_each_mode_in_a_process_of_its_own(tmp_path, monkeypatch) -> None:
    """--process-per-mode: each mode by the script in a process of its own, its report's cases
    merged into one (on a CPU, --smoke keeps eager alone: one process); the flags other than
    --modes and --out reach it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    step_cost = _load("step_cost")
    out = tmp_path / "step-cost.json"
    report = step_cost.main(
        ["--smoke", "--table-gib", "0.001", "--rounds", "1", "--steps", "1", "--warmup-steps",
         "0", "--placements", "aa", "--loops", "sync", "--modes=eager,graph",
         "--process-per-mode", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["process_per_mode"] == ["eager"] and report["rounds_completed"] == {"eager": 1}
    assert {(c["placement"], c["mode"], c["loop"]) for c in report["cases"]} == {
        ("device", "eager", "sync"),
        ("aa", "eager", "sync"),
    }
    assert all(c["table_gib"] == 0.001 and c["check"]["passed"] for c in report["cases"])


def test_step_cost_loops_order_plans_steps_and_waits(monkeypatch) -> None:
    """Each loop's order of plans, steps and waits over two steps: ``sync`` plans the next
    step after waiting for the step's stream, ``sync-prefetch`` before it (right after
    launching this one), ``queued`` never waits between steps."""
    step_cost = _load("step_cost")
    events: list[str] = []

    class Recorder(step_cost.Runner):
        def __init__(self) -> None:
            pass

        def plan(self, batch):
            events.append(f"plan{batch}")
            return batch

        def step(self) -> None:
            events.append("step")

    monkeypatch.setattr(step_cost, "synchronize", lambda: events.append("device"))
    monkeypatch.setattr(step_cost, "wait_for_step", lambda: events.append("wait"))
    expected = {  # timed from an idle device to an idle device; between steps, the step's stream
        "sync": ["device", "plan0", "step", "wait", "plan1", "step", "device"],
        "sync-prefetch": ["device", "plan0", "step", "plan1", "wait", "step", "device"],
        "queued": ["device", "plan0", "step", "plan1", "step", "device"],
    }
    assert set(expected) == set(step_cost.LOOPS)
    for loop, order in expected.items():
        events.clear()
        step_cost.run_steps(Recorder(), [0, 1], loop, prefetch=False)
        assert events == order, loop


def test_step_cost_argument_filter() -> None:
    step_cost = _load("step_cost")
    argv = ["--modes", "a,b", "--x", "1", "--out=o.json", "--process-per-mode", "--modes=c"]
    kept = step_cost._without(argv, ("--process-per-mode",), ("--modes", "--out"))
    assert kept == ["--x", "1"]


def test_step_cost_leaves_unpaired_rounds_out() -> None:
    step_cost = _load("step_cost")
    stats = step_cost.paired_case_stats([2.0, None, 4.0], [1.0, 1.0, None])
    assert stats["pct_rounds"] == [50.0, None, None] and stats["rounds"] == 1
    assert stats["median_pct"] == 50.0 and stats["ms"] == 3.0 and stats["ref_ms"] == 1.0
    with pytest.raises(ValueError, match="expected the same rounds"):
        step_cost.paired_case_stats([1.0], [1.0, 2.0])


def test_step_cost_read_kernels_are_placements_of_their_own() -> None:
    step_cost = _load("step_cost")
    args = step_cost.parse_args(
        ["--smoke", "--placements", "aa", "--read-kernels", "128:16:8,8:2:132"]
    )
    assert [p.name for p in args.placements] == ["aa", "read-128-16-8", "read-8-2-132"]
    placement = args.read_kernels["read-128-16-8"]
    kernel = placement.kernel
    assert (kernel.rows_per_program, kernel.num_warps, kernel.max_programs) == (128, 16, 8)
    default = step_cost.PLACEMENTS["default"]
    assert dataclasses.replace(placement, name="default", kernel=None) == default
    with pytest.raises(SystemExit, match=r"'32:4'.*expected R:W:P"):
        step_cost.parse_args(["--smoke", "--read-kernels", "32:4"])
    with pytest.raises(SystemExit, match=r"'32:3:16'.*num_warps"):
        step_cost.parse_args(["--smoke", "--read-kernels", "32:3:16"])


def test_step_cost_refuses_bad_lists() -> None:
    step_cost = _load("step_cost")
    with pytest.raises(SystemExit, match="--modes='eager,fast'"):
        step_cost.parse_args(["--smoke", "--modes", "eager,fast"])
    with pytest.raises(SystemExit, match="--rounds=0"):
        step_cost.parse_args(["--smoke", "--rounds", "0"])
    with pytest.raises(SystemExit, match="--frozen-profile-steps=0; expected >= 1"):
        step_cost.parse_args(["--smoke", "--frozen-profile-steps", "0"])
    with pytest.raises(SystemExit, match="--engram-blocks='1,x'"):
        step_cost.parse_args(["--smoke", "--engram-blocks", "1,x"])
    with pytest.raises(SystemExit, match=r"--engram-blocks=\[0\]; expected blocks in 1..29"):
        step_cost.parse_args(["--smoke", "--engram-blocks", "0"])
    assert step_cost.parse_args(["--smoke", "--engram-blocks", "14,1,14"]).engram_blocks == [1, 14]


def test_step_timeline_splits_steps_and_finds_the_stall() -> None:
    """step_timeline on a hand-made trace of two steps: the busy union counts overlapping
    streams once, the idle time is the span's rest, the stall is the main stream's wait
    for the first lookup, and the host gap runs from the last synchronisation."""
    step_cost = _load("step_cost")

    def kernel(name: str, ts: float, dur: float, stream: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}  # fmt: skip

    sync = {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 0, "dur": 90}
    events = [
        sync,
        # step 1 (t0 = 100): the hash, block 0 on stream 7 beside the lookup on stream 9,
        # then the head waiting for the lookup (main idle 150..180), then block 1.
        kernel("_ngram_hash_kernel_0d1d", 100, 10, 7),
        kernel("_lookup_rows_kernel", 110, 70, 9),  # 110..180
        kernel("gemm", 110, 40, 7),  # 110..150
        kernel("mm_head", 182, 8, 7),  # starts 2 us after the lookup: it waited
        kernel("gemm", 200, 50, 7),  # 200..250 (190..200 idle)
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 240, "dur": 20},
        # step 2 (t0 = 300): the lookup ends before the main stream needs it: no stall.
        kernel("_ngram_hash_kernel_0d1d", 300, 10, 7),
        kernel("_lookup_rows_kernel", 310, 20, 9),  # 310..330
        kernel("gemm", 310, 60, 7),  # 310..370
        kernel("mm_head", 370, 10, 7),
    ]
    t = step_cost.step_timeline(events)
    assert t is not None and t["steps"] == 2
    # step 1: span 200 (100..300), busy 100..180, 182..190 and 200..250 = 138; step 2:
    # span 80 (300..380, the last kernel's end), busy 80.
    assert t["span"] == pytest.approx((200 + 80) / 2)
    assert t["busy"] == pytest.approx((138 + 80) / 2)
    assert t["idle"] == pytest.approx((62 + 0) / 2)
    assert t["lookups"] == [pytest.approx((70 + 20) / 2)]
    assert t["stall0"] == pytest.approx((180 - 150 + 0) / 2)  # step 2's head did not wait
    assert t["host_gap"] == pytest.approx(((100 - 90) + (300 - 260)) / 2)
    # Negative control: without a hash kernel there are no steps.
    assert step_cost.step_timeline([e for e in events if "hash" not in e["name"]]) is None


def test_copy_engine_reads_addresses_rows_and_needs_a_gpu(capsys) -> None:
    """The study's one computed input (each row's address) and, without CUDA, its refusal."""
    import numpy as np
    import torch

    study = _load("copy_engine_reads")
    ids = np.array([0, 3, 1_000_000_007])
    assert study.row_addresses(4096, ids) == [4096, 4096 + 3 * 264, 4096 + 1_000_000_007 * 264]
    if not torch.cuda.is_available():
        assert study.main(["--rows", "4"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_read_interference_parses_its_sides_and_needs_a_gpu(capsys) -> None:
    """Every default side parses to a kind and valid settings; bad specs are refused by
    name before any table is filled; without CUDA the study refuses."""
    import torch

    from engramrt.lookup.settings import LookupKernelConfig

    study = _load("read_interference")
    default = LookupKernelConfig(rows_per_program=16)
    kinds = [study.parse_side(s)[0] for s in study.DEFAULT_SIDES]
    assert set(kinds) == {"uva", "device", "spin"}
    assert study.kernel_config("default", default) is default
    got = study.kernel_config("8:1:-", default)
    assert (got.rows_per_program, got.num_warps, got.max_programs) == (8, 1, None)
    assert study.kernel_config("32:4:16", default).max_programs == 16
    assert study.spin_args("132:50") == (132, 50.0)
    for bad, word in (("uva[1:2]", "R:W:P"), ("spin[0:5]", "P >= 1"), ("disk[1:1:1]", "expected")):
        with pytest.raises(SystemExit):
            study.main(["--sides", bad])
        assert word in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert study.main(["--sides", "spin[1:5]"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_host_inline_reads_parses_its_variants_and_needs_a_gpu(capsys) -> None:
    """The reference comes first whatever the order given, repeats drop, and a variant it
    does not know or a host gather with no thread is refused by name; without CUDA the
    study refuses."""
    import torch

    study = _load("host_inline_reads")
    assert study.parse_variants("uva,host16,device,uva") == ["device", "uva", "host16"]
    for bad, word in (("uva,gpu", "'gpu'"), ("host0", "at least one thread"), ("hostx", "hostN")):
        with pytest.raises(ValueError, match=word):
            study.parse_variants(bad)
    with pytest.raises(SystemExit):
        study.main(["--variants", "host0"])
    assert "at least one thread" in capsys.readouterr().err
    # Each variant's cost is per round against the reference of that round.
    got = study.summary(
        ["device", "host4"],
        {"device": [1.0, 2.0, 1.0], "host4": [1.1, 2.0, 1.25]},
        {"host4/layer0": [10.0, 30.0, 20.0], "host16/layer0": [99.0]},
    )
    assert got["device"] == {"ms": 1.0}
    assert got["host4"]["median_pct"] == pytest.approx(100 * (1 - 1 / 1.1), abs=0.01)
    assert got["host4"]["p25_pct"] == pytest.approx(100 * (1 - 1 / 1.1) / 2, abs=0.01)
    assert got["host4"]["p75_pct"] == pytest.approx((100 * (1 - 1 / 1.1) + 20) / 2, abs=0.01)
    assert got["host4"]["host_us_layer0"] == 20.0 and got["host4"]["ms"] == 1.25
    if not torch.cuda.is_available():
        assert study.main(["--variants", "uva"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_profile_ple_layer_sweeps_valid_settings_and_needs_a_gpu(capsys) -> None:
    """Every value the sweep tries is a valid launch setting of its field (the config
    refuses others), each field's default among them; without CUDA the script refuses."""
    from dataclasses import fields, replace

    import torch

    from engramrt.families.qwen4_ple.module import DEFAULT_KERNEL_CONFIG

    study = _load("profile_ple_layer")
    assert set(study.KNOBS) == {f.name for f in fields(DEFAULT_KERNEL_CONFIG)}
    for knob, values in study.KNOBS.items():
        assert getattr(DEFAULT_KERNEL_CONFIG, knob) in values, knob
        for value in values:
            assert getattr(replace(DEFAULT_KERNEL_CONFIG, **{knob: value}), knob) == value
    if not torch.cuda.is_available():
        assert study.main(["--no-sweep"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def _trace_event(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


def _synthetic_trace(idle_after_block: list[float]) -> list[dict]:
    """Steps of 1,000 us between waits: a block kernel from 100 to 300, a copy starting
    ``idle`` after it (20 us), then a kernel from the copy's end to 900; the host launches
    a graph at 50 and gathers at 120 for 80 us."""
    events = [_trace_event("cudaStreamSynchronize", "cuda_runtime", -10.0, 10.0)]
    for i, idle in enumerate(idle_after_block):
        t = 1000.0 * i
        copy_at = t + 300 + idle
        events += [
            _trace_event("cudaGraphLaunch", "cuda_runtime", t + 50, 30),
            _trace_event("aten::index_select", "cpu_op", t + 120, 80),
            _trace_event("block", "kernel", t + 100, 200),
            _trace_event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", copy_at, 20),
            _trace_event("tail", "kernel", copy_at + 20, t + 900 - copy_at - 20),
            _trace_event("cudaStreamSynchronize", "cuda_runtime", t + 950, 50),
        ]
    return events


def test_trace_timeline_finds_each_steps_gaps_and_host_calls(tmp_path) -> None:
    """Steps are cut at the ends of the loop's waits (the first and last dropped); the GPU's
    gap before the copy and the host's calls are found in every step, with their medians.
    Control: a gap below --gap-us is not listed, and a trace with no waits is refused."""
    import gzip

    trace_timeline = _load("trace_timeline")
    idle = [40.0, 50.0, 60.0, 70.0, 80.0]  # steps 1..3 are whole: 50, 60, 70
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _synthetic_trace(idle)}, f)
    out = tmp_path / "timeline.json"
    result = trace_timeline.main([str(path), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    steps = result["steps"]
    assert len(steps) == 3 and result["summary"]["steps"] == 3
    for step, gap in zip(steps, (50.0, 60.0, 70.0), strict=True):
        assert step["span_us"] == 1000.0
        # Steps start at the previous wait's end (t = 1000 i): the block begins at 100.
        assert step["gpu_first_us"] == 100.0
        assert step["gaps"][0] == {"at": 300.0, "us": gap, "next": "Memcpy HtoD (Pinned -> Device)"}
        # Idle: before the block, the gap, after the tail.
        assert step["gpu_idle_us"] == pytest.approx(100.0 + gap + 100.0)
        assert [(op["name"], op["at"], op["us"]) for op in step["host"]] == [
            ("cudaGraphLaunch", 50.0, 30.0),
            ("aten::index_select", 120.0, 80.0),
        ]
        assert step["copies"][0]["at"] == 300.0 + gap
    summary = result["summary"]
    assert summary["gaps"] == [
        {"k": 0, "at": 300.0, "us": 60.0, "next": "Memcpy HtoD (Pinned -> Device)"}
    ]
    assert summary["gpu_idle_us"] == pytest.approx(260.0)
    assert [(op["name"], op["us"]) for op in summary["host"]] == [
        ("cudaGraphLaunch", 30.0),
        ("aten::index_select", 80.0),
    ]
    quiet = trace_timeline.main([str(path), "--gap-us", "100"])
    assert all(step["gaps"] == [] for step in quiet["steps"])
    plain = tmp_path / "nowaits.json"
    plain.write_text(
        json.dumps([e for e in _synthetic_trace(idle) if "Synchronize" not in e["name"]])
    )
    with pytest.raises(SystemExit, match="fewer than three cudaStreamSynchronize"):
        trace_timeline.main([str(plain)])
    with pytest.raises(SystemExit, match=r"--gap-us=-1.0; expected >= 0"):
        trace_timeline.main([str(path), "--gap-us", "-1"])
    with pytest.raises(SystemExit, match=r"missing\.json'. no such file"):
        trace_timeline.main([str(tmp_path / "missing.json")])


def test_step_cost_copies_placements_split_queued_gathers_on_their_layers() -> None:
    """``queued-copies`` and ``queued-copies-4``: every layer a queued gather, split at its
    kernel (``lookup_overlap="copies"``), no GPU reads, the second on 4 threads;
    ``copies-last``: only layer 1 so (layer 0 keeps the default store, whose small batches
    the GPU reads). Control: ``queued-cpu`` queues every layer without the split."""
    import torch

    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    step_cost = _load("step_cost")
    placements = step_cost.PLACEMENTS
    layout = EngramLayout(PRESETS["tiny"])
    for name, threads in (("queued-copies", None), ("queued-copies-4", 4)):
        placement = placements[name]
        assert placement.runtime_options()["lookup_overlap"] == "copies"
        stores = step_cost.host_stores(layout, torch.device("cpu"), placement, None)
        assert [(s.splits_lookup, s.num_threads) for s in stores] == [(True, threads)] * 2
    last = placements["copies-last"]
    assert last.runtime_options()["lookup_overlap"] == "copies" and not last.cpu_only
    stores = step_cost.host_stores(layout, torch.device("cpu"), last, None)
    assert [s.splits_lookup for s in stores] == [False, True]
    assert [s.queued for s in stores] == [False, True]
    control = placements["queued-cpu"]
    assert control.runtime_options()["lookup_overlap"] == "side"
    assert all(s.queued for s in step_cost.host_stores(layout, torch.device("cpu"), control, None))


def test_step_cost_at_layer_placements_keep_lookup_kernels_off_the_blocks() -> None:
    """``at-layer``, ``at-layer-queued``, ``at-layer-copies``: ``lookup_overlap="layer"``
    over the default stores, over queued gathers with every layer's GPU reads, and over
    queued gathers with layer 0's only (layer 1 then split at its kernel, on 4 threads).
    Control: ``default`` keeps its lookups beside the blocks."""
    import torch

    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    step_cost = _load("step_cost")
    placements = step_cost.PLACEMENTS
    layout = EngramLayout(PRESETS["tiny"])
    cpu = torch.device("cpu")
    expected = {  # name: (gpu_reads, queued stores, gather threads)
        "at-layer": ("all", False, None),
        "at-layer-queued": ("all", True, None),
        "at-layer-copies": ("first", True, 4),
    }
    for name, (reads, queued, threads) in expected.items():
        options = placements[name].runtime_options()
        assert options["lookup_overlap"] == "layer", name
        assert options.get("gpu_reads", "all") == reads, name
        stores = step_cost.host_stores(layout, cpu, placements[name], None)
        assert [(s.queued, s.num_threads) for s in stores] == [(queued, threads)] * 2, name
    assert placements["default"].runtime_options()["lookup_overlap"] == "side"


def test_step_cost_frozen_cache_placements_front_layer_0_with_a_filled_frozen_cache(
    tmp_path, monkeypatch
) -> None:
    """``frozen-first*``: layer 0's host store behind a frozen cache of 5% of its table,
    filled from the profile (its rows held, nothing admitted while serving); layer 1 as the
    placement sets it. Then the placement through the smoke harness: its rows pass the
    check against the GPU tables. Control: the plain host store of layer 1."""
    import torch

    from engramrt.cache import CachedRowStore
    from engramrt.config import PRESETS
    from engramrt.layout import EngramLayout

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    step_cost = _load("step_cost")
    placement = step_cost.PLACEMENTS["frozen-first"]
    layout = EngramLayout(PRESETS["tiny"])
    stores = step_cost.host_stores(layout, torch.device("cpu"), placement, None)
    g = torch.Generator().manual_seed(0)
    rows = min(s.num_rows for s in stores)
    profile = [(torch.rand(8, 2, layout.config.n_cols, generator=g) ** 4 * rows).long()]
    cached = step_cost.frozen_caches(stores, placement, profile)
    cache = cached[0]
    assert isinstance(cache, CachedRowStore) and cache.frozen and cache.backing is stores[0]
    assert cache.num_slots == stores[0].num_rows * 5 // 100 // cache.ways * cache.ways
    assert int((cache.policy.tags >= 0).sum()) > 0  # filled from the profile
    assert cached[1] is stores[1] and not isinstance(cached[1], CachedRowStore)
    queued = step_cost.PLACEMENTS["frozen-first-queued"]
    assert queued.runtime_options()["gpu_reads"] == "first" and queued.gather == "queued"
    assert step_cost.PLACEMENTS["frozen-first-layer"].runtime_options()["lookup_overlap"] == (
        "layer"
    )
    report = step_cost.main(
        ["--smoke", "--table-gib", "0.001", "--rounds", "1", "--steps", "1", "--warmup-steps",
         "0", "--placements", "aa,frozen-first", "--loops", "sync", "--frozen-profile-steps",
         "2", "--out", str(tmp_path / "step-cost.json")]
    )  # fmt: skip
    checks = {c["placement"]: c["check"] for c in report["cases"]}
    assert checks["frozen-first"]["passed"] and checks["frozen-first"]["rows_equal"]
    (held,) = report["frozen_caches"]["frozen-first"].values()  # layer 0 only
    assert held["share"] == 0.05 and 0 < held["rows_held"] <= held["slots"]
    assert held["lookups"] > 0 and 0 <= held["hit_rate"] <= 1
