"""The training command end to end on a CPU slice, and the corpus / vocab rules it uses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engramrt_lab.models import artifacts
from engramrt_lab.models.corpus import Split, corpus_row_ids, eval_segments, is_heldout
from engramrt_lab.models.vocab import BOS_TOKEN_ID, Vocab


def test_training_writes_every_artifact(trained_dir: Path) -> None:
    for name in (*artifacts.SHIPPED_FILES, artifacts.LOSS_CURVES, artifacts.TRAIN_LOG):
        assert (trained_dir / name).is_file(), name
    assert not (trained_dir / "_work").exists()  # the float source checkpoint is removed
    data = json.loads((trained_dir / artifacts.MODEL_JSON).read_text())
    record = data["training"]
    # Three models, the same steps and windows.
    assert record["engram"]["steps"] == record["baseline"]["steps"] == 4
    assert record["baseline_wide"]["steps"] == 4
    assert record["engram"]["tokens_seen"] == 4 * 2 * 64
    losses = record["heldout"]["losses"]
    assert set(losses) == {"engram", "baseline", "baseline_wide", "engram_fp8"}
    assert set(record["package_heldout"]["losses"]) == set(losses)
    assert record["package_heldout"]["packages"] == ["click"]
    sample = record["heldout"]["sample_losses"]
    assert abs(sample["engram_fp8_served"] - sample["engram_fp8"]) / sample["engram_fp8"] < 2e-3
    assert all(math.isfinite(v) and 0 < v < 20 for v in losses.values())
    # fp8 rows change the loss a little, never by much (target <= 0.5% after training).
    assert abs(record["heldout"]["fp8_vs_float_relative"]) < 0.01
    corpus = record["corpus"]
    assert corpus["train_files"] == 12 and corpus["heldout_files"] == 1
    assert corpus["package_heldout_files"] == 1 and corpus["validation_files"] == 1
    assert corpus["dropped_exact_duplicates"] == 2  # copy.py and the reindented near.py
    assert corpus["train_tokens"] > 1000 and corpus["heldout_tokens"] > 10
    assert len(record["engram"]["loss_curve"]) == 4
    # The FLOP-matched baseline: dense parameters within one MLP unit of the Engram model's.
    wide, engram = record["baseline_wide"], record["engram"]
    unit = 3 * data["lm"]["dim"] * data["lm"]["n_blocks"]
    assert abs(wide["dense_parameters"] - engram["dense_parameters"]) <= unit
    assert engram["table_parameters"] > 0 == wide["table_parameters"]
    assert set(data["checksums"]) == set(data["files"].values())
    from engramrt.config import EngramConfig, load_config

    assert load_config(trained_dir) == EngramConfig.from_hf_dict(data["engram"])
    log = json.loads((trained_dir / artifacts.TRAIN_LOG).read_text())
    assert len(log["losses"]["engram"]) == 4 and log["log"]
    results = json.loads((trained_dir / "results.json").read_text())
    assert set(results["models"]) == {"engram", "baseline", "baseline_wide", "engram_x1"}
    sweep = results["memory_sweep"]
    assert [p["name"] for p in sweep] == ["engram", "engram_x1"]  # x8 is "engram"
    assert sweep[0]["multiple_of_tiny_buckets"] == 8
    assert sweep[1]["buckets_per_head"] == [6144, 4096, 2048]
    assert results["models"]["engram_x1"]["steps"] == 4
    # Four steps of 2 x 64 tokens reach a small share of each table, larger for the
    # table an eighth the size.
    reached = [p["rows_reached"] for p in sweep]
    assert len(reached[0]) == len(record["engram"]["engram_layers"])
    assert all(0 < r < 1 for r in reached[0]) and reached[1][0] > reached[0][0]
    # The file view partitions the same predictions as the others; its per-file means,
    # weighted by predictions, give back the held-out loss evaluated separately.
    # The same on the held-out packages, against that set's own losses.
    for key, split in (("where_it_wins", "heldout"), ("where_it_wins_package", "package_heldout")):
        wins = results[key]
        by_file = wins["file"]
        total = sum(row["predictions"] for row in wins["context"].values())
        assert total > 0 and sum(row["predictions"] for row in by_file.values()) == total
        for model in ("engram", "baseline", "baseline_wide"):
            mean = sum(row["predictions"] * row[model] for row in by_file.values()) / total
            assert mean == pytest.approx(record[split]["losses"][model], abs=1e-4), key
    # Negative control: the two sets' splits are of different predictions.
    assert (
        results["where_it_wins"]["file"].keys() != results["where_it_wins_package"]["file"].keys()
    )
    # The memory's state at every validation: one entry per point of the validation
    # curve, a gate in [0, 1] per Engram block and a row RMS per table.
    curve = engram["engram_curve"]
    assert [step for step, _ in curve] == [step for step, _ in engram["validation_curve"]]
    blocks = {str(b) for b in engram["engram_layers"]}
    assert all(set(state["gate"]) == blocks for _, state in curve)
    assert all(0 <= g <= 1 for _, state in curve for g in state["gate"].values())
    assert all(len(state["row_rms"]) == len(blocks) for _, state in curve)


def test_packaged_model_fits_the_size_budget() -> None:
    """The shipped directory: at most 50 MB in all, no file over 40 MiB, and every file
    model.json names carries the SHA-256 recorded there."""
    import hashlib

    from engramrt_lab.models.packaged import packaged_model_dir

    directory = packaged_model_dir()
    sizes = {name: (directory / name).stat().st_size for name in artifacts.SHIPPED_FILES}
    assert sum(sizes.values()) <= 50_000_000, sizes
    assert max(sizes.values()) <= 40 * 2**20, sizes
    data = json.loads((directory / artifacts.MODEL_JSON).read_text())
    for name, digest in data["checksums"].items():
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest, name
    # model.json itself: SHA-256 of its other fields, keys sorted, no spaces.
    fields = {k: v for k, v in data.items() if k != "model_json_sha256"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert data["model_json_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()


def _absolute_paths(value: object) -> list[str]:
    """Every word of every string in ``value`` (a JSON value, keys included) that is an
    absolute path, POSIX or Windows, quotes and brackets stripped."""
    import re
    from pathlib import PurePosixPath, PureWindowsPath

    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _absolute_paths(key) + _absolute_paths(item)
    elif isinstance(value, list):
        for item in value:
            found += _absolute_paths(item)
    elif isinstance(value, str):
        for word in re.split(r"[\s,=]+", value):
            word = word.strip("'\"()[]<>")
            if PurePosixPath(word).is_absolute() or PureWindowsPath(word).drive:
                found.append(word)
    return found


def test_absolute_paths_are_found() -> None:
    """Control for the two tests below: the record this package once shipped is caught."""
    old = {
        "command": "/work/x/train.py --out /tmp/model --results /root/out/results.json",
        "corpus": {"stdlib_root": "/usr/lib/python3.12", "site_dirs": ["C:\\Python\\Lib"]},
        "rule": "stdlib: int(sha256(relative_path)) % 20 == 0",
    }
    assert _absolute_paths(old) == [
        "/work/x/train.py",
        "/tmp/model",
        "/root/out/results.json",
        "/usr/lib/python3.12",
        "C:\\Python\\Lib",
    ]


def test_the_shipped_model_json_holds_no_absolute_path() -> None:
    """The shipped record says how the model was trained, not where: its command is the
    training command without --out and --results, its corpus roots are names."""
    import shlex

    from engramrt_lab.models.packaged import packaged_model_dir
    from engramrt_lab.models.train import parse_args, settings_record

    data = json.loads((packaged_model_dir() / artifacts.MODEL_JSON).read_text())
    assert _absolute_paths(data) == []
    record = data["training"]
    words = shlex.split(record["command"])
    assert words[:3] == ["python", "-m", "engramrt_lab.models.train"]
    assert "--out" not in words and "--results" not in words
    # It parses back to the settings recorded (on this CPU once --device says cpu).
    words[words.index("--device") + 1] = "cpu"
    again = settings_record(parse_args([*words[3:], "--out", "unused"]))
    assert again.pop("device") == "cpu" and record["settings"]["device"] == "cuda"
    assert again == {k: v for k, v in record["settings"].items() if k != "device"}
    assert record["corpus"]["stdlib_root"] == "python3.12"
    assert record["corpus"]["site_dirs"] == ["site-packages"]


def test_the_trained_record_holds_no_absolute_path(
    trained_dir: Path, tiny_sources, tmp_path: Path
) -> None:
    """A run given --out, --results, --stdlib-root and --site-dirs (absolute temporary
    paths) records none of them: the command parses back to the same settings once an
    --out and the roots are given again."""
    import shlex

    from engramrt_lab.models.train import parse_args, settings_record

    data = json.loads((trained_dir / artifacts.MODEL_JSON).read_text())
    results = json.loads((trained_dir / "results.json").read_text())
    assert _absolute_paths(data) == [] and _absolute_paths(results) == []
    record = data["training"]
    stdlib, site = tiny_sources
    assert record["corpus"]["stdlib_root"] == stdlib.name
    assert record["settings"]["site_dirs"] == [site.name]
    words = shlex.split(record["command"])
    assert words[:3] == ["python", "-m", "engramrt_lab.models.train"]
    assert "--out" not in words and "--results" not in words
    assert words[words.index("--stdlib-root") + 1] == f"<{stdlib.name}>"
    words[words.index("--stdlib-root") + 1] = str(stdlib)
    words[words.index("--site-dirs") + 1] = str(site)
    again = parse_args([*words[3:], "--out", str(tmp_path / "again")])
    assert settings_record(again) == record["settings"]


def test_heldout_rule_is_the_documented_hash() -> None:
    import hashlib

    for path in ("os.py", "json/decoder.py", "asyncio/tasks.py", "x/y/z.py"):
        want = int(hashlib.sha256(path.encode()).hexdigest(), 16) % 20 == 0
        assert is_heldout(path) == want
    names = [f"m{i}.py" for i in range(400)]
    held = [n for n in names if is_heldout(n)]
    assert 5 <= len(held) <= 45  # about 1 in 20


def test_vocab_rule() -> None:
    counts = np.array([1, 0, 5, 7, 5, 0, 9, 2])
    vocab = Vocab.from_counts(counts, 4)
    # BOS first, then counts descending with ties by id: 6 (9), 3 (7), 2 (5).
    assert vocab.token_ids == (BOS_TOKEN_ID, 6, 3, 2)
    assert vocab.other_id == 4 and vocab.size == 5
    np.testing.assert_array_equal(vocab.trim([0, 6, 3, 2, 4, 7, 1]), [0, 1, 2, 3, 4, 4, 4])
    np.testing.assert_array_equal(vocab.untrim([1, 2, 3]), [6, 3, 2])
    with pytest.raises(ValueError, match="trimmed ids"):
        vocab.untrim([4])
    assert Vocab.from_dict(vocab.to_dict()) == vocab
    # Fewer distinct tokens than K: K shrinks.
    assert Vocab.from_counts(np.array([0, 3, 0, 1]), 10).token_ids == (0, 1, 3)


def test_corpus_row_ids_restart_at_every_document(token_map) -> None:
    """Each document hashes as its own request from position 0 (pad history), bit for
    bit as :func:`hash_sequence` of that document alone; a control shows that hashing
    the stream as one sequence differs."""
    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants, hash_sequence

    consts = HashConstants.from_config(PRESETS["tiny"], token_map)
    rng = np.random.default_rng(5)
    docs = [np.concatenate([[0], rng.integers(3, 120_000, n)]) for n in (7, 1, 30, 12)]
    starts = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    split = Split([f"d{i}.py" for i in range(4)], np.concatenate(docs), starts)
    ids, report = corpus_row_ids(split, consts, token_map.map, torch.device("cpu"))
    assert report["checked_against_hash_sequence"] > 0
    got = ids.to(torch.int64).numpy()
    for d, doc in enumerate(docs):
        want = hash_sequence(token_map.map[doc], consts)
        np.testing.assert_array_equal(got[starts[d] : starts[d + 1]], want)
    whole = hash_sequence(token_map.map[split.tokens], consts)
    assert not np.array_equal(got, whole)
    # The kernel path (what CUDA runs; here through Triton's interpreter) agrees.
    kernel_ids, report = corpus_row_ids(
        split, consts, token_map.map, torch.device("cpu"), kernel=True
    )
    assert report["kernel_mismatched_tokens"] == 0 and "kernel_error" not in report
    assert torch.equal(kernel_ids, ids)


def test_eval_segments_stay_inside_documents() -> None:
    docs = [np.arange(100, 100 + n) for n in (5, 12, 1, 9)]
    starts = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    split = Split(["a", "b", "c", "d"], np.concatenate(docs), starts)
    segments = eval_segments(split, seq_len=4, max_sequences=100, max_ngram_size=4)
    # a: [0:4], [4:5] dropped (1 token); b: 3 pieces of 4; c: dropped; d: 4, 4, 1 dropped.
    np.testing.assert_array_equal(segments.lengths, [4, 4, 4, 4, 4, 4])
    np.testing.assert_array_equal(segments.positions, [0, 0, 4, 8, 0, 4])
    # b's second piece starts at its position 4: lookback = positions 3, 2, 1 of b.
    np.testing.assert_array_equal(segments.lookback[2], [103, 102, 101])
    np.testing.assert_array_equal(segments.lookback[0], [-1, -1, -1])
    np.testing.assert_array_equal(segments.tokens[5], [104, 105, 106, 107])


def test_time_budget_fixes_the_schedule_and_the_baseline_follows(tmp_path: Path) -> None:
    """With a wall-clock budget the step count is fixed after the probe steps and the
    run ends near the budget; the baseline then runs exactly as many steps with the
    same schedule length."""
    from engramrt_lab.models.lm import LMConfig, TinyLM
    from engramrt_lab.models.train import TrainSettings, train_model
    from engramrt_lab.training import EngramTable

    settings = TrainSettings(out=tmp_path, batch_size=2, seq_len=8)
    config = LMConfig(
        vocab_size=50,
        dim=32,
        n_blocks=2,
        n_heads=2,
        head_dim=16,
        mlp_dim=32,
        engram_layer_ids=(1,),
        engram_cols=2,
        engram_head_dim=32,
    )
    tokens = torch.randint(0, 50, (4000,))
    row_ids = torch.randint(0, 64, (4000, 1, 2), dtype=torch.int32)
    torch.manual_seed(0)
    model, tables = TinyLM(config), [EngramTable(64, 32)]
    ticks = iter(range(10**6))

    def clock() -> float:  # simulated: 5 ms per reading, whatever the machine's load
        return next(ticks) * 5e-3

    budget = 0.5
    run = train_model(
        "engram",
        model,
        tables,
        tokens,
        row_ids,
        settings,
        steps=None,
        budget_s=budget,
        clock=clock,
    )
    assert 20 < run.steps == run.schedule_steps
    assert 0.9 * budget <= run.seconds <= 1.1 * budget + 0.05
    assert len(run.losses) == run.steps and all(math.isfinite(v) for v in run.losses)
    baseline = train_model(
        "baseline",
        TinyLM(config.baseline()),
        [],
        tokens,
        None,
        settings,
        steps=run.steps,
        budget_s=None,
        schedule_steps=run.schedule_steps,
    )
    assert baseline.steps == run.steps and baseline.schedule_steps == run.schedule_steps


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "0"], "--steps=0 must be at least 1"),
        (["--minutes", "0"], "--minutes=0.0 must be positive"),
        (["--minutes", "nan"], "--minutes=nan must be positive"),
        (["--eval-every", "0"], "--eval-every=0 must be at least 1"),
    ],
)
def test_train_command_refuses_bad_numbers(capsys, args, needle) -> None:
    from engramrt_lab.models.train import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--out", "x", *args])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_engram_layers_start_as_the_identity() -> None:
    """The value part of wkv starts at zero: each Engram layer returns its input streams
    exactly, whatever the rows; the key part (so the gate) is random. Control: with
    engram_identity=False the same layer changes the streams."""
    from engramrt_lab.models.lm import LMConfig, TinyLM

    config = LMConfig(
        vocab_size=50, dim=32, n_blocks=2, n_heads=2, head_dim=16, mlp_dim=32,
        engram_layer_ids=(1,), engram_cols=2, engram_head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyLM(config)
    head = model.engram_head(1)
    hc, dim = config.hc_mult, config.dim
    assert torch.count_nonzero(head.wkv.weight[hc * dim :]) == 0
    assert torch.count_nonzero(head.wkv.weight[: hc * dim]) == hc * dim * 64
    streams = torch.randn(2, 3, hc, dim)
    rows = torch.randn(6, 2, 32)
    assert torch.equal(head(streams, rows), streams)
    model.reset_parameters(engram_identity=False)
    assert not torch.allclose(model.engram_head(1)(streams, rows), streams)


@pytest.mark.parametrize("engram_init", ["rows-zero", "value-zero"])
def test_rows_zero_learns_only_the_rows_training_reaches(engram_init: str) -> None:
    """--engram-init rows-zero: the rows start at zero and the value projection normal, so
    the layer starts as the identity; one training step moves every row the batch looked
    up and leaves every other row exactly zero (its value is zero: the layer adds nothing
    there). Control: value-zero with rows at zero moves no row at all (no gradient reaches
    them), the reason value-zero needs --table-init-std > 0."""
    from engramrt_lab.models import train
    from engramrt_lab.models.lm import TinyLM
    from engramrt_lab.training import EngramTable

    settings = train.TrainSettings(
        out=Path("."), batch_size=2, seq_len=16, dim=32, n_blocks=2, mlp_dim=32,
        engram_init=engram_init, table_init_std=0.0,
    )  # fmt: skip
    cfg = train.engram_config(settings.dim, buckets=(7, 5, 3), layers=(1,))
    lm_cfg = train.lm_configs(settings, 40, cfg)
    torch.manual_seed(0)
    model = TinyLM(lm_cfg)
    if engram_init == "rows-zero":
        model.engram_values_normal_()
    head = model.engram_head(1)
    hc, dim = lm_cfg.hc_mult, lm_cfg.dim
    values = head.wkv.weight[hc * dim :]
    assert (torch.count_nonzero(values) == values.numel()) == (engram_init == "rows-zero")
    table = EngramTable(cfg.num_embeddings[0], cfg.head_dim, init_std=0.0)
    streams = torch.randn(1, 4, hc, dim)
    zero_rows = torch.zeros(4, lm_cfg.engram_cols, cfg.head_dim)
    assert torch.equal(head(streams, zero_rows), streams)

    generator = torch.Generator().manual_seed(1)
    stream = settings.batch_size * (settings.seq_len + 1)
    tokens = torch.randint(0, 40, (stream,), generator=generator)
    num_rows = table.weight.shape[0]
    reached = torch.randperm(num_rows, generator=generator)[: num_rows // 2]
    pick = torch.randint(0, reached.numel(), (stream, 1, lm_cfg.engram_cols), generator=generator)
    row_ids = reached[pick]  # [L, 1, C]: only rows of `reached`
    index = torch.arange(stream).view(settings.batch_size, settings.seq_len + 1)
    used = torch.zeros(num_rows, dtype=torch.bool)
    used[row_ids[index[:, :-1]].flatten()] = True
    optimizers = train.make_optimizers(model, [table], settings)
    train.train_step(
        model, lambda i, ids: table(ids), optimizers, tokens, row_ids, index,
        lr_factor=1.0, settings=settings,
    )  # fmt: skip
    moved = table.weight.detach().abs().sum(dim=1) > 0
    assert not moved[~used].any()
    assert moved[used].all() == (engram_init == "rows-zero")
    assert moved.any() == (engram_init == "rows-zero")


def test_rows_reached_counts_the_rows_of_the_trained_windows_only() -> None:
    """rows_reached: the share of rows looked up at the input positions of the batches
    trained, against a brute-force set over the same positions. Control: the positions
    of the windows not trained hold rows of their own, which must not count."""
    from engramrt_lab.models.train import OnePassWindows, rows_reached

    seq_len, batch, steps, cols = 4, 2, 2, 3
    num_tokens = 8 * seq_len + 1  # 8 windows, 4 batches: half of them trained
    windows = OnePassWindows(num_tokens, seq_len, batch, seed=5, device=torch.device("cpu"))
    num_rows = (97, 50)
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack(
        [torch.randint(0, r, (num_tokens, cols), generator=generator) for r in num_rows], dim=1
    ).int()  # [T, L, C]
    trained = {int(w) for w in windows.order[: steps * batch]}
    want = []
    for layer, rows in enumerate(num_rows):
        seen = {
            int(ids[w * seq_len + j, layer, c])
            for w in trained
            for j in range(seq_len)
            for c in range(cols)
        }
        want.append(round(len(seen) / rows, 6))
    assert rows_reached(ids, windows, steps, num_rows) == want
    # The untrained windows' rows: a value only they hold is outside the share.
    untrained = sorted(set(range(windows.num_windows)) - trained)
    ids[untrained[0] * seq_len, 0, 0] = 96
    ids[[w * seq_len + j for w in trained for j in range(seq_len)], 0, :] %= 96
    got = rows_reached(ids, windows, steps, num_rows)[0]
    assert got * 97 == pytest.approx(
        len(
            {
                int(v)
                for v in ids[
                    [w * seq_len + j for w in trained for j in range(seq_len)], 0, :
                ].flatten()
            }
        )
    )
    assert rows_reached(ids, windows, windows.steps, num_rows)[0] > got


def test_engram_state_means_the_gates_of_predictions_only() -> None:
    """engram_state: a block's gate is the mean over positions < length - 1 of every
    sequence (two batches concatenated in order), against a hand sum; padding positions
    hold a gate of 9, which would show if they counted. row_rms is the table's RMS."""
    from engramrt_lab.models.train import engram_state
    from engramrt_lab.training import EngramTable

    lengths = torch.tensor([4, 2, 3])
    first = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 9.0, 9.0]])
    second = torch.tensor([[0.7, 0.9, 9.0, 9.0]])
    table = EngramTable(10, 32, init_std=0.0)
    with torch.no_grad():
        table.weight.fill_(0.5)
    state = engram_state({3: [first, second]}, lengths, [table])
    want = (0.1 + 0.2 + 0.3 + 0.5 + 0.7 + 0.9) / 6
    assert state["gate"] == {"3": pytest.approx(want, abs=1e-5)}
    assert state["row_rms"] == [0.5]
