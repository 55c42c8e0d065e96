"""The where-it-wins categories against a brute-force reading of the same sequences."""

from __future__ import annotations

import numpy as np
import pytest

from engramrt_lab.models.wins import category_losses, category_masks, ngram_keys, training_ngrams


def test_categories_match_a_brute_force_count() -> None:
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 6, size=(20, 9))  # small alphabet: many n-grams repeat
    seen = training_ngrams(windows)
    grams = {
        n: {tuple(w[i : i + n]) for w in windows for i in range(w.size - n + 1)} for n in (2, 3, 4)
    }
    tokens = rng.integers(0, 8, size=(5, 7))  # ids 6, 7 never trained on
    lengths = np.array([7, 7, 5, 2, 7])
    lookback = np.array([[-1, -1, -1], [3, 2, 1], [0, -1, -1], [1, 1, 1], [5, 4, 3]])
    masks = category_masks(tokens, lengths, lookback, seen)
    for m in range(5):
        ext = [int(t) for t in lookback[m, ::-1]] + [int(t) for t in tokens[m]]
        for j in range(6):
            cats = {name for name, mask in masks["longest_seen"].items() if mask[m, j]}
            ctx = {name for name, mask in masks["context"].items() if mask[m, j]}
            if j + 1 >= lengths[m]:
                assert not cats and not ctx
                continue
            end = j + 1 + 3  # ext index of the target

            def hit(n: int, end: int = end, ext: list[int] = ext) -> bool:
                gram = ext[end - n + 1 : end + 1]
                return min(gram) >= 0 and tuple(gram) in grams[n]

            longest = next((n for n in (4, 3, 2) if hit(n)), 0)
            want = {
                4: "4-gram seen",
                3: "3-gram seen, 4-gram not",
                2: "2-gram seen, 3-gram not",
                0: "bigram unseen",
            }[longest]
            assert cats == {want}
            context = ext[end - 3 : end]
            context_seen = min(context) >= 0 and tuple(context) in grams[3]
            if context_seen and hit(4):
                assert ctx == {"context seen, continuation seen"}
            elif context_seen:
                assert ctx == {"context seen, continuation new"}
            else:
                assert ctx == {"context unseen"}
    losses = np.where(np.arange(1, 7)[None, :] < lengths[:, None], 1.0, np.nan)
    table = category_losses(masks, {"a": losses, "b": 2 * losses})
    total = sum(row["predictions"] for row in table["longest_seen"].values())
    assert total == int((lengths - 1).sum())
    for row in table["context"].values():
        if row["predictions"]:
            assert row["a"] == 1.0 and row["b"] == 2.0


def test_keys_mark_missing_tokens() -> None:
    keys = ngram_keys(np.array([[1, 2, -1, 3, 4]]), 2)
    assert keys[0, 1] == 0 and keys[0, 2] == 0 and keys[0, 0] != 0 and keys[0, 3] != 0
    assert ngram_keys(np.array([[1, 2]]), 2)[0, 0] != ngram_keys(np.array([[2, 1]]), 2)[0, 0]


def test_where_it_wins_script_on_a_trained_directory(trained_dir, tiny_sources, tmp_path) -> None:
    """bench/where_it_wins.py rebuilds the run's corpus (the manifest matches), its
    per-model means equal the recorded held-out losses (exit 0), and the two-half mode
    (masks saved, then read) gives the same table."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "where_it_wins.py"
    spec = importlib.util.spec_from_file_location("where_it_wins", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    whole, half = tmp_path / "whole.json", tmp_path / "half.json"
    stdlib, site = tiny_sources
    args = ["--model", str(trained_dir), "--device", "cpu"]
    # The record names the run's source directories only: without the flags, one error.
    with pytest.raises(SystemExit, match="give --stdlib-root"):
        script.main([*args, "--out", str(whole)])
    args += ["--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    assert script.main([*args, "--out", str(whole)]) == 0
    assert script.main([*args, "--save-masks", str(tmp_path / "m.npz")]) == 0
    assert script.main([*args, "--masks", str(tmp_path / "m.npz"), "--out", str(half)]) == 0
    a, b = json.loads(whole.read_text()), json.loads(half.read_text())
    assert a["categories"] == b["categories"] and a["corpus_differences"] == []
    assert a["trained_windows"] == 4 * 2  # 4 steps of 2 windows
    rows = a["categories"]["longest_seen"].values()
    assert sum(r["predictions"] for r in rows) == a["heldout_predictions"]


def test_file_masks_partition_predictions_by_the_file_of_each_sequence() -> None:
    """Three sequences cut from two files (the second and third from file b): each
    file's mask holds exactly its sequences' valid predictions, the masks partition
    the valid predictions, and a file no sequence comes from is left out. Offsets
    outside the split and a doc_starts of the wrong length are refused, by name."""
    from engramrt.errors import ValidationError
    from engramrt_lab.models.wins import file_masks

    files = ["a.py", "b.py", "c.py"]
    doc_starts = np.array([0, 10, 30, 40])
    lengths = np.array([4, 2, 5])
    starts = np.array([3, 10, 22])
    masks = file_masks(6, lengths, starts, doc_starts[:3], files[:2])
    assert list(masks) == ["a.py", "b.py"]
    assert masks["a.py"].shape == (3, 5)
    assert masks["a.py"].sum() == 3 and masks["a.py"][0, :3].all()
    assert masks["b.py"].sum() == 1 + 4 and not masks["b.py"][0].any()
    valid = np.arange(1, 6)[None, :] < lengths[:, None]
    assert np.array_equal(masks["a.py"] | masks["b.py"], valid)
    assert not (masks["a.py"] & masks["b.py"]).any()
    assert list(file_masks(6, lengths, starts, doc_starts, files)) == ["a.py", "b.py"]
    with pytest.raises(ValidationError, match=r"starts holds offsets in \[3, 40\]"):
        file_masks(6, lengths, np.array([3, 10, 40]), doc_starts, files)
    with pytest.raises(ValidationError, match=r"doc_starts has shape \(2,\)"):
        file_masks(6, lengths, starts, doc_starts[:2], files[:2])


def test_gate_column_parts_reads_back_gate_column() -> None:
    """Every gate key parses back to its model and block (names with spaces and digits
    included); a model's loss key and a count are not gate keys."""
    from engramrt_lab.models.wins import gate_column, gate_column_parts

    for model, block in (("engram", 1), ("engram_x2", 14), ("engram (layers 1, 2)", 2)):
        assert gate_column_parts(gate_column(model, block)) == (model, block)
    for other in ("engram", "baseline_wide", "predictions", "share", "engram gate (block x)"):
        assert gate_column_parts(other) is None
