"""Two models over the same seeds, paired by seed, per held-out category."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from engramrt.errors import ValidationError
from engramrt_lab.models import pairs

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
CATEGORIES = {"seen": 300, "unseen": 100}  # predictions per category: shares 0.75, 0.25


def _record(model: str, seed: int | None, losses: dict[str, float], gate: float) -> dict:
    """A training record of ``model`` whose stdlib categories have these mean losses (the
    set's loss their share-weighted mean) and no package split."""
    total = sum(CATEGORIES.values())
    categories = {
        name: {
            "predictions": n,
            "share": n / total,
            model: losses[name],
            f"{model} gate (block 1)": gate,
            f"{model} gate (block 3)": gate / 2,
        }
        for name, n in CATEGORIES.items()
    }
    heldout = sum(CATEGORIES[c] * losses[c] for c in CATEGORIES) / total
    command = "python -m engramrt_lab.models.train --steps 10" + (
        "" if seed is None else f" --seed {seed}"
    )
    return {
        "command": command,
        "models": {model: {"losses": {"heldout": heldout, "package_heldout": heldout + 1}}},
        "where_it_wins": {"longest_seen": categories},
    }


def _sides() -> tuple[dict[str, Any], dict[str, Any]]:
    first = {
        "a0": _record("small", None, {"seen": 1.0, "unseen": 3.0}, 0.4),
        "a1": _record("small", 1, {"seen": 1.2, "unseen": 3.2}, 0.5),
        "a2": _record("small", 2, {"seen": 1.1, "unseen": 2.9}, 0.6),
    }
    second = {  # seed order shuffled: pairing goes by seed, not by position
        "b2": _record("big", 2, {"seen": 0.9, "unseen": 3.0}, 0.7),
        "b0": _record("big", 0, {"seen": 0.8, "unseen": 3.1}, 0.5),
        "b1": _record("big", 1, {"seen": 1.1, "unseen": 3.3}, 0.6),
    }
    return first, second


def test_differences_are_paired_by_seed_and_add_up_to_the_set() -> None:
    first, second = _sides()
    result = pairs.compare("small", first, "big", second)
    assert result["seeds"] == [0, 1, 2]
    assert result["records"] == {"from": ["a0", "a1", "a2"], "to": ["b0", "b1", "b2"]}
    assert list(result["sets"]) == ["stdlib"]  # no record splits the packages
    seen = result["sets"]["stdlib"]["categories"]["seen"]
    differences = [0.8 - 1.0, 1.1 - 1.2, 0.9 - 1.1]
    assert seen["difference"]["mean"] == pytest.approx(statistics.mean(differences))
    assert seen["difference"]["std"] == pytest.approx(statistics.stdev(differences))
    assert seen["from"]["mean"] == pytest.approx(1.1) and seen["share"] == 0.75
    assert seen["gates"]["from"] == pytest.approx({"1": 0.5, "3": 0.25})
    assert seen["gates"]["to"] == pytest.approx({"1": 0.6, "3": 0.3})
    whole = result["sets"]["stdlib"]["whole"]
    assert whole["per_seed_categories_summed"] == pytest.approx(whole["per_seed_difference"])
    expected = [0.75 * (0.8 - 1.0) + 0.25 * (3.1 - 3.0), 0.75 * -0.1 + 0.25 * 0.1, -0.15 + 0.025]
    assert whole["per_seed_difference"] == pytest.approx(expected)
    # Control: paired by position instead, the seen differences would spread otherwise.
    by_position = [0.9 - 1.0, 0.8 - 1.2, 1.1 - 1.1]
    assert seen["difference"]["std"] != pytest.approx(statistics.stdev(by_position))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f, s: s.pop("b2"), r"--from covers seeds \[0, 1, 2\] and --to seeds \[0, 1\]"),
        (lambda f, s: s.update(b3=_record("big", 1, {"seen": 1, "unseen": 3}, 0.5)),
         r"--to has two records of seed 1 \(b1 and b3\)"),
        (lambda f, s: f.update(a1=_record("other", 1, {"seen": 1, "unseen": 3}, 0.5)),
         r"--from record a1 holds models \['other'\]; expected 'small'"),
        (lambda f, s: s["b1"]["where_it_wins"]["longest_seen"]["seen"].update(predictions=299),
         r"seed 1: a1 and b1 scored different predictions"),
        (lambda f, s: s["b1"]["where_it_wins"]["longest_seen"]["seen"].pop("big"),
         r"record b1's where_it_wins\['longest_seen'\] has no 'big'"),
        (lambda f, s: s["b0"].pop("where_it_wins"), r"no held-out set is split in every record"),
        (lambda f, s: [s.pop("b1"), s.pop("b2"), f.pop("a1"), f.pop("a2")],
         r"1 seed; expected at least 2"),
    ],
)  # fmt: skip
def test_records_that_do_not_pair_are_refused(change, message) -> None:
    first, second = _sides()
    change(first, second)
    with pytest.raises(ValidationError, match=message):
        pairs.compare("small", first, "big", second)


def test_a_view_a_record_lacks_is_named() -> None:
    first, second = _sides()
    with pytest.raises(ValidationError, match=r"record a0 has no where_it_wins\['context'\]"):
        pairs.compare("small", first, "big", second, view="context")


def test_command_writes_json_and_prints_the_tables(tmp_path: Path, capsys) -> None:
    first, second = _sides()
    paths = {}
    for name, record in {**first, **second}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(record))
    out = tmp_path / "pairs.json"
    argv = ["--from", "small", *(str(paths[n]) for n in first)]
    argv += ["--to", "big", *(str(paths[n]) for n in second), "--json", str(out)]
    assert pairs.main(argv) == 0
    text = capsys.readouterr().out
    assert "| seen | 0.750 | 1.1000 | 0.9333 | -0.1667 ± 0.0577 [-0.2000, -0.1000] |" in text
    named = (
        {str(paths[n]): r for n, r in first.items()},
        {str(paths[n]): r for n, r in second.items()},
    )
    assert json.loads(out.read_text()) == pairs.compare("small", named[0], "big", named[1])
    with pytest.raises(SystemExit) as exited:
        pairs.main(["--from", "small", str(paths["a0"]), "--to", "big", str(tmp_path / "no")])
    assert exited.value.code == 2
    assert "--to record" in capsys.readouterr().err


def test_the_committed_memory_sizes_split_into_their_categories() -> None:
    """The ×2 and ×4 records of the memory curve: per seed and held-out set, the categories'
    share-weighted differences add up to the difference of the records' own set losses (the
    categories partition the predictions; shares are rounded to 1e-4 in the records)."""
    first = {
        str(p): json.loads(p.read_text())
        for p in (
            RESULTS / "tiny-lm-train-20261207T1330Z.json",
            RESULTS / "tiny-lm-ship-20261207T1602Z-seed1-engram.json",
            RESULTS / "tiny-lm-ship-20261207T1602Z-seed2-engram.json",
        )
    }
    second = {
        str(p): json.loads(p.read_text())
        for p in sorted(RESULTS.glob("tiny-lm-long-20261207T1607Z-seed[012]-sweep+x4.json"))
    }
    result = pairs.compare("engram", first, "engram_x4", second)
    assert list(result["sets"]) == ["stdlib", "site-packages"]
    for data in result["sets"].values():
        whole = data["whole"]
        assert whole["per_seed_categories_summed"] == pytest.approx(
            whole["per_seed_difference"], abs=1e-3
        )
