"""Every comparison of the training command over several seeds, with its spread, in one command.

On a GPU (the training command's settings, once per seed)::

    python -m engramrt_lab.models.seeds --seeds 0,1,2 --out DIR --steps 842 --device cuda \
        --eval-sequences 4096 --val-sequences 256 --memory-sweep 1,2,4,8,16

Any flag of ``python -m engramrt_lab.models.train`` may follow, except ``--seed``,
``--out`` and ``--results``, which this command sets per seed. For each seed
``s`` in ``--seeds`` it runs that command (:func:`engramrt_lab.models.train.main`,
unchanged) with ``--seed s --out DIR/seed-s --results DIR/seed-s.json``: the
model directory and the per-seed record (the ``--results`` JSON: every model's
losses, the memory sweep, where it wins). The seed sets the models'
initialisation and the order of the training windows. Then it writes

- ``DIR/seeds.json`` (:func:`aggregate`): over the seeds, per held-out set
  (``heldout``: the stdlib held-out files; ``package_heldout``: the held-out
  packages) and model (``engram``, its fp8 tables ``engram_fp8``,
  ``baseline``, the FLOP-matched ``baseline_wide``), the mean held-out loss
  (``heldout_loss``) and its spread (``heldout_spread``: ``std``, the sample
  standard deviation with ddof = 1, and ``min``, ``max``); the same for every
  memory-sweep point (``sweep``, keyed by its multiple of the ``tiny`` preset's
  buckets, the main Engram model included) and for every where-it-wins
  category's losses and Engram gates (``unseen``: predictions split by
  whether their n-grams were seen in training, :mod:`engramrt_lab.models.wins`,
  first the ``seen`` view: the predictions whose 4-gram training saw and the
  rest, :func:`seen_view`; ``unseen_package``: the same on the held-out packages);
  the per-seed values beside each; ``stopped_early``, the seeds whose record is of a
  run stopped before its end (its finished models only); written atomically;
- ``DIR/seeds.md``: the same as short Markdown tables (mean ± std [min, max]);
- into every seed's ``model.json``, the per-seed held-out losses
  (:func:`fold_into_model_dir`: the training record's ``heldout_seeds``), so
  that the directory shipped as the demo's model carries the spread it is
  reported with (:func:`heldout_figures`).

With ``--aggregate`` it trains nothing: it aggregates the records ``DIR/seed-S.json``
already there (seeds trained at other times or on other machines, each by the training
command with ``--seed S --out DIR/seed-S --results DIR/seed-S.json``), refused unless
their training commands are the same but for ``--seed`` and each names its own seed,
and folds into each ``DIR/seed-S`` that holds a model.

With ``--models M1,M2`` (the training command's: some of ``engram``, ``baseline``,
``baseline_wide``; ``--steps`` required) each seed's run trains only those models and
writes no model directory: its record is ``DIR/seed-S-M1+M2.json``. ``--models sweep``
trains only the Engram models of ``--memory-sweep`` (and ``--compare-layers``), into
``DIR/seed-S-sweep+x1+x2.json`` (named by its points), beside a run of ``--models
engram`` that gives the curve its point at the main model's size. The records of a
seed's runs in DIR (``seed-S.json`` and every ``seed-S-*.json``) are merged before the
aggregate (:func:`merge_records`: refused unless trained by the same command but for
``--models``, with no model in two of them), so the models of one comparison can train
in separate runs, at other times or on other machines::

    python -m engramrt_lab.models.seeds --seeds 0,1,2 --out DIR --models engram --steps 1321 ...
    python -m engramrt_lab.models.seeds --seeds 0,1,2 --out DIR --models baseline,baseline_wide \
        --steps 1321 ...

With ``--jobs J`` up to J seeds train at once, each in a process of its own, its
output in ``DIR/seed-S.log``. On one GPU that saves only the processes' start (the
corpus, about a minute each): the tiny model's training keeps an H200 busy, and four
processes side by side trained at a quarter of one alone's tokens per second each.

One seed (``--seeds S``) trains into the same layout and writes no aggregate, so that
seeds can join one at a time before an ``--aggregate`` (which needs at least two).

Flags are checked for every seed before any training (a bad one: one line,
exit status 2). A seed whose run fails stops the command with that run's exit
status; the seeds already run keep their records, and no aggregate is written.
With ``--minutes`` each seed fixes its own step count from its timing; with
``--steps`` every seed trains the same steps (the aggregate lists each seed's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engramrt._io import atomic_write_bytes
from engramrt.errors import CheckpointError
from engramrt_lab.models import artifacts
from engramrt_lab.models.cli_parser import OneLineParser

__all__ = [
    "HELDOUT_SEEDS",
    "HELDOUT_SET_NAMES",
    "aggregate",
    "fold_into_model_dir",
    "heldout_figures",
    "heldout_seeds_record",
    "main",
    "markdown",
    "spread",
]

PROG = "python -m engramrt_lab.models.seeds"
AGGREGATE_JSON = "seeds.json"
SUMMARY_MD = "seeds.md"
HELDOUT_SETS = ("heldout", "package_heldout")
"""The two held-out sets: the stdlib held-out files and the held-out packages."""
HELDOUT_SET_NAMES = {"heldout": "stdlib", "package_heldout": "site-packages"}
"""How reports name each held-out set of a training record: ``stdlib``, the held-out
files of the standard library; ``site-packages``, the held-out top-level packages
(:data:`~engramrt_lab.models.corpus.HELDOUT_PACKAGES`) of the site directories."""
HELDOUT_SEEDS = "heldout_seeds"
"""The field of a ``model.json`` training record that holds every seed's held-out losses
(:func:`heldout_seeds_record`)."""
MIN_SEEDS = 2
"""A sample standard deviation needs two values; the issue asks reports for three."""
_SET_FLAGS = ("--seed", "--out", "--results")
TRAIN_MODULE = "engramrt_lab.models.train"
"""The training command each seed runs (``python -m``, with ``--jobs`` above 1)."""


def spread(values: Sequence[float]) -> dict[str, float]:
    """``mean``, ``std`` (sample standard deviation, ddof = 1), ``min`` and ``max`` of
    ``values`` (at least two)."""
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()),
        "std": float(array.std(ddof=1)),
        "min": float(array.min()),
        "max": float(array.max()),
    }


def _seed_dir(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


def _seed_record(out: Path, seed: int, models: Sequence[str] | None = None) -> Path:
    """``DIR/seed-S.json``, or ``DIR/seed-S-M1+M2.json`` for a run of some models."""
    return out / (f"seed-{seed}.json" if not models else f"seed-{seed}-{'+'.join(models)}.json")


def _seed_records(out: Path, seed: int) -> list[Path]:
    """Every record of seed ``seed`` in ``out``: its run of all three models and its runs
    of some (``seed-S-*.json``), sorted."""
    whole = _seed_record(out, seed)
    return ([whole] if whole.is_file() else []) + sorted(out.glob(f"seed-{seed}-*.json"))


_WHICH_MODELS = ("--models", "--memory-sweep", "--compare-layers")
"""The training command's flags that choose which models a run trains, not how."""


_ENGRAM_ONLY = ("--buckets", "--unseen-rate", "--short-conv", "--short-conv-dilation")
"""The training command's flags that change only the Engram models (their tables' size, the
positions they train on as new n-grams, the convolution after their gates): a run that
trains no Engram model (the baselines) is the same whatever they say. Not ``--wkv-heads``:
the FLOP-matched baseline's width follows the Engram projection's size."""


def _without(words: list[str], flags: tuple[str, ...]) -> list[str]:
    """``words`` without each of ``flags`` and the value after it."""
    return [w for i, w in enumerate(words) if w not in flags and not (i and words[i - 1] in flags)]


def _without_models(command: str) -> list[str]:
    """A training command's words without the flags of :data:`_WHICH_MODELS`."""
    return _without(shlex.split(command), _WHICH_MODELS)


def _trains_engram(part: Mapping[str, Any]) -> bool:
    """Whether a run's record holds an Engram model (``engram``, a sweep point, ...)."""
    return any(name.startswith("engram") for name in part.get("models") or {})


def merge_records(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One seed's record from the records of its runs of some models (``--models``):
    their models, where-it-wins columns and memory-sweep points together. Refused
    (:class:`ValueError`, naming what differs) unless the runs were trained alike: the
    same command but for the flags that choose models (``--models``, ``--memory-sweep``,
    ``--compare-layers``; so the same seed, steps and windows) and, for a run that trains
    no Engram model, but for the flags that change only the Engram models
    (:data:`_ENGRAM_ONLY`: its baselines are the same whatever they say), models that no two
    runs share, and the same predictions in every where-it-wins category. The merged
    record's ``command`` is its first Engram run's (else its first run's). The held-out
    summaries of a run of all three models are left out (each model's losses stay in
    ``models``); the merged record is finished when every run is."""
    if len(parts) == 1:
        return dict(parts[0])
    commands = [_without_models(str(part.get("command", ""))) for part in parts]
    engram = [_trains_engram(part) for part in parts]
    command = commands[engram.index(True) if True in engram else 0]
    merged: dict[str, Any] = {
        "command": shlex.join(command),
        "steps": parts[0].get("steps"),
        "models": {},
        **{key: {} for key in WINS},
        "memory_sweep": [],
    }
    for part, other, trains_engram in zip(parts, commands, engram, strict=True):
        if trains_engram:
            same = other == command
        else:
            same = _without(other, _ENGRAM_ONLY) == _without(command, _ENGRAM_ONLY)
        if not same:
            raise ValueError(
                f"a run of this seed was trained by {shlex.join(other)!r}, another by "
                f"{shlex.join(command)!r} (--models and the sweep aside, and "
                f"{', '.join(_ENGRAM_ONLY)} for a run of baselines); expected the same settings"
            )
        if part.get("steps") != merged["steps"]:
            raise ValueError(
                f"runs of this seed trained {part.get('steps')} and {merged['steps']} steps; "
                f"expected one schedule"
            )
        for name, model in (part.get("models") or {}).items():
            if name in merged["models"]:
                raise ValueError(f"model {name!r} is in two runs of this seed; expected one")
            merged["models"][name] = model
        for key, (_, label) in WINS.items():
            for view, categories in (part.get(key) or {}).items():
                for category, row in categories.items():
                    cell = merged[key].setdefault(view, {}).setdefault(category, {})
                    for column, value in row.items():
                        if column in cell and cell[column] != value:
                            raise ValueError(
                                f"where it wins ({label}), {view} / {category}: {column} is "
                                f"{value} in one run and {cell[column]} in another; expected "
                                f"the same predictions"
                            )
                        cell[column] = value
        named = {p["name"] for p in merged["memory_sweep"]}
        for point in part.get("memory_sweep") or []:
            if point["name"] in named:
                raise ValueError(f"sweep point {point['name']!r} is in two runs of this seed")
            merged["memory_sweep"].append(point)
    if all("seconds_total" in part for part in parts):
        merged["seconds_total"] = sum(float(part["seconds_total"]) for part in parts)
    return merged


def _sweep_key(point: Mapping[str, Any], taken: Mapping[str, Any]) -> str:
    key = f"{point['multiple_of_tiny_buckets']:g}"
    return key if key not in taken else f"{key} ({point['name']})"


WINS = {
    "where_it_wins": ("unseen", "stdlib held-out"),
    "where_it_wins_package": ("unseen_package", "package held-out"),
}
"""Each record key of a where-it-wins split (the training command's
:data:`~engramrt_lab.models.train.WHERE_IT_WINS`): the aggregate's field for it and the
held-out set it splits."""

SEEN_VIEW, SEEN, UNSEEN = "seen", "4-gram seen", "4-gram unseen"
"""The aggregate's view of each record's ``longest_seen`` categories folded in two
(:func:`seen_view`): the predictions whose 4-gram (three context tokens and the
continuation) training saw, and the rest."""


def seen_view(longest: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """One record's ``longest_seen`` view (:mod:`engramrt_lab.models.wins`) folded into
    :data:`SEEN` (that category as it is) and :data:`UNSEEN` (every other category:
    ``predictions`` and ``share`` summed, every other column the prediction-weighted mean
    of the categories' means, a category with no predictions left out); None when the
    view has no :data:`SEEN` category, or another category no count. A column some
    non-empty category lacks is left out."""
    if SEEN not in longest:
        return None
    others = [row for name, row in longest.items() if name != SEEN]
    if not others or not all(isinstance(row.get("predictions"), int) for row in others):
        return None
    counted = [row for row in others if row["predictions"] > 0]
    total = sum(row["predictions"] for row in counted)
    unseen: dict[str, Any] = {
        "predictions": total,
        "share": round(sum(float(row.get("share") or 0.0) for row in others), 4),
    }
    for column in dict.fromkeys(c for row in counted for c in row):
        values = [row.get(column) for row in counted]
        if column in unseen or not all(isinstance(v, (int, float)) for v in values):
            continue
        unseen[column] = (
            sum(r["predictions"] * v for r, v in zip(counted, values, strict=True)) / total
        )
    return {SEEN: dict(longest[SEEN]), UNSEEN: unseen}


def _with_seen_view(wins: Any) -> Any:
    """A record's ``where_it_wins`` with :data:`SEEN_VIEW` first, where it can be made."""
    if not isinstance(wins, Mapping) or not isinstance(wins.get("longest_seen"), Mapping):
        return wins
    view = seen_view(wins["longest_seen"])
    return wins if view is None else {SEEN_VIEW: view, **wins}


def aggregate(records: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The aggregate of per-seed records (``--results`` JSONs of the training command,
    by seed): means and spreads (:func:`spread`) of every held-out loss, sweep point and
    where-it-wins category; see the module docstring. A value that a seed lacks (no
    package held-out set on that machine, a sweep point or category missing) is left
    out rather than averaged over fewer seeds."""
    seeds = sorted(records)
    if len(seeds) < MIN_SEEDS:
        raise ValueError(f"records holds {len(seeds)} seed(s); expected at least {MIN_SEEDS}")

    # The sweep by point name, so that every value is reached by a path of keys; a record
    # of a run stopped before its held-out summary gives each set's losses per model.
    views = {
        seed: {
            **record,
            **{
                split: _losses_by_model(record, split)
                for split in HELDOUT_SETS
                if not isinstance(record.get(split), Mapping)
            },
            "sweep_by_name": {p["name"]: p for p in record.get("memory_sweep") or []},
            **{key: _with_seen_view(record.get(key)) for key in WINS},
        }
        for seed, record in records.items()
    }

    def over_seeds(*path: str) -> dict[str, Any] | None:
        """The spread of the value at ``path`` in every seed's record (None if a seed
        lacks it or it is not a finite number)."""
        values = []
        for seed in seeds:
            value: Any = views[seed]
            for key in path:
                if not isinstance(value, Mapping) or key not in value:
                    return None
                value = value[key]
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return None
            values.append(float(value))
        return {**spread(values), "per_seed": values}

    heldout_loss: dict[str, dict[str, float]] = {}
    heldout_spread: dict[str, dict[str, dict[str, Any]]] = {}
    first = views[seeds[0]]
    for split in HELDOUT_SETS:
        models = ((first.get(split) or {}).get("losses") or {}).keys()
        for model in models:
            stats = over_seeds(split, "losses", model)
            if stats is None:
                continue
            heldout_loss.setdefault(split, {})[model] = stats["mean"]
            heldout_spread.setdefault(split, {})[model] = {
                k: stats[k] for k in ("std", "min", "max", "per_seed")
            }
    sweep: dict[str, dict[str, Any]] = {}
    points = first.get("memory_sweep") or []
    # By table size, whatever order the runs that trained them were merged in.
    for point in sorted(points, key=lambda p: p["multiple_of_tiny_buckets"]):
        entry: dict[str, Any] = {
            "name": point["name"],
            "multiple_of_tiny_buckets": point["multiple_of_tiny_buckets"],
            "buckets_per_head": point["buckets_per_head"],
        }
        for split in HELDOUT_SETS:
            stats = over_seeds("sweep_by_name", point["name"], "losses", split)
            if stats is not None:
                entry[split] = stats
        sweep[_sweep_key(point, sweep)] = entry
    unseen: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for key, (field_name, _) in WINS.items():
        views_of_set = unseen.setdefault(field_name, {})
        for view, categories in (first.get(key) or {}).items():
            for category, row in categories.items():
                cell: dict[str, Any] = {}
                for column in row:
                    stats = over_seeds(key, view, category, column)
                    if stats is not None:
                        cell[column] = stats
                views_of_set.setdefault(view, {})[category] = cell
    return {
        "seeds": len(seeds),
        "stopped_early": [s for s in seeds if "seconds_total" not in records[s]],
        "seed_values": seeds,
        "spread": "std: sample standard deviation over the seeds (ddof = 1); min, max",
        "steps": {str(s): (records[s].get("steps") or {}).get("steps") for s in seeds},
        "heldout_loss": heldout_loss,
        "heldout_spread": heldout_spread,
        "sweep": sweep,
        **unseen,
    }


def _losses_by_model(record: Mapping[str, Any], split: str) -> dict[str, Any] | None:
    """``{"losses": {model: loss}}`` of held-out set ``split`` from the models a record
    holds (``models.NAME.losses``), for a run stopped before its summary of that set;
    None when no model has it."""
    losses = {
        name: model["losses"][split]
        for name, model in (record.get("models") or {}).items()
        if isinstance(model, Mapping) and split in (model.get("losses") or {})
    }
    return {"losses": losses} if losses else None


def heldout_seeds_record(summary: Mapping[str, Any]) -> dict[str, Any]:
    """What a training record keeps of an :func:`aggregate` (``seeds.json``): ``seeds``
    (the seed values), ``steps`` (each seed's, by seed) and ``losses`` (per held-out set
    of :data:`HELDOUT_SETS` and model, the held-out loss of every seed, in the order of
    ``seeds``)."""
    return {
        "seeds": list(summary["seed_values"]),
        "steps": dict(summary["steps"]),
        "spread": "reports: mean and sample standard deviation (ddof = 1) of the seeds' losses",
        "losses": {
            split: {model: list(stats["per_seed"]) for model, stats in models.items()}
            for split, models in summary["heldout_spread"].items()
        },
    }


def fold_into_model_dir(directory: Path, summary: Mapping[str, Any]) -> dict[str, Any]:
    """Write the per-seed held-out losses of an :func:`aggregate` into the training record
    of ``directory/model.json`` (field :data:`HELDOUT_SEEDS`), atomically and sealed again
    (:func:`~engramrt_lab.models.artifacts.write_model_json`); returns that field.

    Refused (:class:`~engramrt.errors.CheckpointError`) unless the directory's model is
    one of the seeds: its record's seed is among ``summary``'s, and every held-out loss
    the aggregate holds for that seed is the one its record holds. The other files and
    their checksums are left as they are.
    """
    data = artifacts.read_model_json(directory)
    record = data["training"]
    where = str(Path(directory) / artifacts.MODEL_JSON)
    folded = heldout_seeds_record(summary)
    seed = (record.get("settings") or {}).get("seed")
    if seed not in folded["seeds"]:
        raise CheckpointError(
            f"{where!r}: training.settings.seed={seed!r} is not one of the aggregate's seeds "
            f"{folded['seeds']}; expected the model directory of one of them"
        )
    index = folded["seeds"].index(seed)
    for split, models in folded["losses"].items():
        for model, values in models.items():
            own = ((record.get(split) or {}).get("losses") or {}).get(model)
            if own != values[index]:
                raise CheckpointError(
                    f"{where!r}: training.{split}.losses.{model}={own!r} but the aggregate "
                    f"records {values[index]!r} for seed {seed}; expected the model directory "
                    f"that seed's run wrote"
                )
    record[HELDOUT_SEEDS] = folded
    artifacts.write_model_json(Path(directory) / artifacts.MODEL_JSON, data)
    return folded


def heldout_figures(record: Mapping[str, Any]) -> dict[str, Any]:
    """The held-out losses a training record reports, per set (named as
    :data:`HELDOUT_SET_NAMES`) and model: over every seed of its :data:`HELDOUT_SEEDS`
    when it holds several, else its own run's.

    Returns ``{"seeds": n, "loss": {set: {model: mean}}, "spread": {set: {model: sample
    std, or None for one seed}}, "per_seed": {set: {model: [loss, ...]}}}``; a set the
    record lacks (no held-out package on the machine that trained) is left out. A
    malformed :data:`HELDOUT_SEEDS` is refused (:class:`~engramrt.errors.CheckpointError`
    naming the field).
    """
    folded = record.get(HELDOUT_SEEDS)
    if folded is None:
        per_seed = {
            split: {model: [float(value)] for model, value in record[split]["losses"].items()}
            for split in HELDOUT_SETS
            if isinstance(record.get(split), Mapping)
        }
        count = 1
    else:
        per_seed, count = _checked_seeds(folded)
    loss: dict[str, dict[str, float]] = {}
    spreads: dict[str, dict[str, float | None]] = {}
    for split, models in per_seed.items():
        name = HELDOUT_SET_NAMES[split]
        for model, values in models.items():
            stats = spread(values) if count >= MIN_SEEDS else None
            loss.setdefault(name, {})[model] = stats["mean"] if stats else values[0]
            spreads.setdefault(name, {})[model] = stats["std"] if stats else None
    return {
        "seeds": count,
        "loss": loss,
        "spread": spreads,
        "per_seed": {HELDOUT_SET_NAMES[split]: models for split, models in per_seed.items()},
    }


def _checked_seeds(folded: Any) -> tuple[dict[str, dict[str, list[float]]], int]:
    """The per-seed losses of a :data:`HELDOUT_SEEDS` field and the seed count."""

    def refuse(field: str, found: Any, expected: str) -> CheckpointError:
        name = ".".join(("training", HELDOUT_SEEDS, *([field] if field else [])))
        return CheckpointError(f"model.json: {name}={found!r}; expected {expected}")

    if not isinstance(folded, Mapping):
        raise refuse("", folded, "an object (written by fold_into_model_dir)")
    seeds = folded.get("seeds")
    if (
        not isinstance(seeds, list)
        or len(seeds) < MIN_SEEDS
        or not all(isinstance(s, int) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise refuse("seeds", seeds, f"at least {MIN_SEEDS} distinct integer seeds")
    losses = folded.get("losses")
    if not isinstance(losses, Mapping) or not set(losses) <= set(HELDOUT_SETS) or not losses:
        raise refuse("losses", losses, f"losses per held-out set of {list(HELDOUT_SETS)}")
    per_seed: dict[str, dict[str, list[float]]] = {}
    for split, models in losses.items():
        if not isinstance(models, Mapping):
            raise refuse(f"losses.{split}", models, "losses per model")
        for model, values in models.items():
            if (
                not isinstance(values, list)
                or len(values) != len(seeds)
                or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in values
                )
            ):
                raise refuse(
                    f"losses.{split}.{model}", values, f"{len(seeds)} finite losses, one per seed"
                )
            per_seed.setdefault(split, {})[model] = [float(v) for v in values]
    return per_seed, len(seeds)


def _cell(stats: Mapping[str, Any] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['mean']:.4f} ± {stats['std']:.4f} [{stats['min']:.4f}, {stats['max']:.4f}]"


def markdown(summary: Mapping[str, Any]) -> str:
    """Short Markdown tables of an :func:`aggregate`: mean ± std [min, max] over seeds."""
    n = summary["seeds"]
    lines = [
        f"# Over {n} seeds ({', '.join(map(str, summary['seed_values']))})",
        "",
        "mean ± std [min, max]; std is the sample standard deviation (ddof = 1).",
        "",
        *(
            [
                f"Seeds whose run stopped before its end (the models it finished): "
                f"{', '.join(map(str, summary['stopped_early']))}.",
                "",
            ]
            if summary.get("stopped_early")
            else []
        ),
        "| model | stdlib held-out | package held-out |",
        "| --- | ---: | ---: |",
    ]
    means, spreads = summary["heldout_loss"], summary["heldout_spread"]
    models = list(dict.fromkeys(m for split in means.values() for m in split))
    for model in models:
        cells = [
            _cell({"mean": means[s][model], **spreads[s][model]})
            if model in means.get(s, {})
            else "-"
            for s in HELDOUT_SETS
        ]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    if summary["sweep"]:
        lines += ["", "| tables | stdlib held-out | package held-out |", "| --- | ---: | ---: |"]
        for key, entry in summary["sweep"].items():
            cells = [_cell(entry.get(s)) for s in HELDOUT_SETS]
            lines.append(f"| x{key} | " + " | ".join(cells) + " |")
    for field_name, label in WINS.values():
        lines += _wins_tables(summary.get(field_name) or {}, label)
    return "\n".join(lines) + "\n"


def _wins_tables(views: Mapping[str, Mapping[str, Any]], label: str) -> list[str]:
    """The Markdown tables of one held-out set's where-it-wins views."""
    lines: list[str] = []
    for view, categories in views.items():
        columns = list(
            dict.fromkeys(
                c for cell in categories.values() for c in cell if c not in ("predictions",)
            )
        )
        lines += [
            "",
            f"where it wins, {view} ({label}):",
            "",
            f"| {'file' if view == 'file' else 'category'} | " + " | ".join(columns) + " |",
            "| --- | " + " | ".join("---:" for _ in columns) + " |",
        ]
        for category, cell in categories.items():
            cells = [_cell(cell.get(c)) for c in columns]
            lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return lines


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}; expected comma-separated integers, e.g. 0,1,2"
        ) from None


def parse_args(
    argv: Sequence[str] | None,
) -> tuple[tuple[int, ...], Path, list[list[str]], int]:
    """The seeds, ``--out`` and each seed's training command line; every seed's flags
    are checked here by the training command's parser, before any work."""
    from engramrt_lab.models import train

    parser = OneLineParser(
        prog=PROG,
        description="Train the tiny Engram LM and its baselines once per seed; aggregate.",
        epilog="Any other flag goes to python -m engramrt_lab.models.train (see its --help).",
        allow_abbrev=False,  # else --seed would silently be read as --seeds
    )
    parser.add_argument("--seeds", type=_seeds, default=(0, 1, 2), help="default 0,1,2")
    parser.add_argument("--out", type=Path, required=True, help="directory of every seed's run")
    parser.add_argument(
        "--aggregate",
        action="store_true",
        help="train nothing: aggregate the records DIR/seed-S.json already there (seeds "
        "trained at other times or on other machines, each by the training command with "
        "--seed S --out DIR/seed-S --results DIR/seed-S.json and the same other flags)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help="the training command's --models: a run of some models writes each seed's "
        "record as DIR/seed-S-M1+M2.json (no model directory); the records of one seed's "
        "runs are merged for the aggregate, so models trained at other times join it",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="seeds trained at once, each in its own process with its output in "
        "DIR/seed-S.log (default 1: one after another, in this process); with --minutes "
        "each seed's step count then reflects the shared device",
    )
    args, rest = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs}; expected at least 1")
    taken = [a for a in rest if a.split("=")[0] in _SET_FLAGS]
    if taken:
        parser.error(f"{taken[0]} is set per seed by this command; leave it out")
    seeds = args.seeds
    fewest = MIN_SEEDS if args.aggregate else 1  # one seed trains; an aggregate needs two
    if len(seeds) < fewest or len(set(seeds)) != len(seeds):
        parser.error(
            f"--seeds={','.join(map(str, seeds))}; expected "
            + (f"at least {fewest} distinct seeds" if fewest > 1 else "distinct seeds")
            + (" to aggregate" if args.aggregate else "")
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out={str(out)!r} exists and is not a directory")
    if args.aggregate:
        if rest or args.models is not None:
            flag = rest[0] if rest else "--models"
            parser.error(f"--aggregate trains nothing, so it takes no training flag; got {flag!r}")
        missing = [str(_seed_record(out, s)) for s in seeds if not _seed_records(out, s)]
        if missing:
            parser.error(
                f"--aggregate needs every seed's record; {missing[0]!r} is missing (expected "
                f"the --results of the training command run with --seed and --out DIR/seed-S, "
                f"or seed-S-M1+M2.json of its runs of some --models)"
            )
        return seeds, out, [], args.jobs
    given = [] if args.models is None else ["--models", args.models]
    named = [n.strip() for n in (args.models or "").split(",")]
    some = tuple(n for n in train.MODEL_NAMES if n in named)
    some = () if some == train.MODEL_NAMES else some
    if named == [train.SWEEP_ONLY]:
        probe = [*rest, *given, "--seed", str(seeds[0]), "--results", "-"]
        some = _sweep_names(train.parse_args(probe))  # exits 2 if it cannot work
    commands = []
    for seed in seeds:
        where = (
            ["--results", str(_seed_record(out, seed, some))]
            if some
            else ["--out", str(_seed_dir(out, seed)), "--results", str(_seed_record(out, seed))]
        )
        command = [*rest, *given, "--seed", str(seed), *where]
        train.parse_args(command)  # exits 2, naming the flag, if it cannot work
        commands.append(command)
    return seeds, out, commands, args.jobs


def _sweep_names(settings: Any) -> tuple[str, ...]:
    """A ``--models sweep`` run's part of its record's name: ``sweep`` and its points
    (``seed-S-sweep+x1+x2.json``), so that runs of other points do not share a record."""
    from engramrt_lab.models.train import SWEEP_ONLY, layers_model_name, sweep_model_name

    names = [sweep_model_name(m) for m in settings.memory_sweep]
    if settings.compare_layers is not None:
        names.append(layers_model_name(settings.compare_layers))
    return (SWEEP_ONLY, *(name.removeprefix("engram_") for name in names))


def _run_in_processes(
    seeds: Sequence[int],
    out: Path,
    commands: Sequence[list[str]],
    jobs: int,
    *,
    module: str = TRAIN_MODULE,
    env_path: Path | None = None,
) -> dict[int, int]:
    """Each seed's training command (``python -m module``) in a process of its own, at
    most ``jobs`` at once, output to ``DIR/seed-S.log``: the exit status of every seed
    started (all of them unless one fails: then no new seed starts and the running ones
    finish). ``env_path`` goes first on the processes' ``PYTHONPATH``."""
    env = None
    if env_path is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(env_path), os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
    pending = list(zip(seeds, commands, strict=True))
    running: dict[int, tuple[subprocess.Popen[bytes], Any]] = {}
    statuses: dict[int, int] = {}
    while pending or running:
        while pending and len(running) < jobs and all(v == 0 for v in statuses.values()):
            seed, command = pending.pop(0)
            log = (out / f"seed-{seed}.log").open("wb")
            print(f"{PROG}: seed {seed} started (output in {log.name})", flush=True)
            process = subprocess.Popen(
                [sys.executable, "-m", module, *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            running[seed] = (process, log)
        if not running:
            break
        time.sleep(0.2)
        for seed, (process, log) in list(running.items()):
            status = process.poll()
            if status is not None:
                log.close()
                del running[seed]
                statuses[seed] = status
                print(f"{PROG}: seed {seed} finished (exit status {status})", flush=True)
    return statuses


def main(argv: Sequence[str] | None = None) -> int:
    seeds, out, commands, jobs = parse_args(argv)
    if commands:  # without --aggregate: train every seed first
        status = _train_seeds(seeds, out, commands, jobs)
        if status != 0:
            return status
        if len(seeds) < MIN_SEEDS:
            print(
                f"{PROG}: seed {seeds[0]} trained into {str(out)!r}; no aggregate: it needs "
                f"at least {MIN_SEEDS} seeds (train others into the same directory, then "
                f"--aggregate)",
                flush=True,
            )
            return 0
    records = {}
    for seed in seeds:
        parts = []
        for path in _seed_records(out, seed):
            try:
                part = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                sys.stderr.write(
                    f"{PROG}: error: {str(path)!r} is not a readable JSON record ({error}); "
                    f"expected the --results of the training command; no aggregate written\n"
                )
                return 2
            if not isinstance(part, dict):
                sys.stderr.write(
                    f"{PROG}: error: {str(path)!r} holds {type(part).__name__}; expected "
                    f"the JSON object the training command's --results writes\n"
                )
                return 2
            parts.append(part)
        if not parts:
            sys.stderr.write(
                f"{PROG}: error: seed {seed} has no record in {str(out)!r} (expected "
                f"{_seed_record(out, seed).name}, the training command's --results, or "
                f"seed-{seed}-M1+M2.json of its runs of some --models); no aggregate written\n"
            )
            return 2
        try:
            records[seed] = merge_records(parts)
        except ValueError as error:
            names = ", ".join(p.name for p in _seed_records(out, seed))
            sys.stderr.write(
                f"{PROG}: error: seed {seed} ({names}): {error}; no aggregate written\n"
            )
            return 2
    return _write_aggregate(seeds, out, records, argv)


def _train_seeds(seeds: Sequence[int], out: Path, commands: Sequence[list[str]], jobs: int) -> int:
    """Every seed's training command (in this process with ``jobs`` 1, else in ``jobs``
    processes at once): 0, or the exit status of the first seed that failed."""
    from engramrt_lab.models import train

    out.mkdir(parents=True, exist_ok=True)
    if jobs > 1:
        statuses = _run_in_processes(seeds, out, commands, jobs)
        failed = {seed: status for seed, status in statuses.items() if status != 0}
        if failed:
            seed, status = next(iter(failed.items()))
            sys.stderr.write(
                f"{PROG}: error: seed {seed} failed (exit status {status}, its output in "
                f"seed-{seed}.log); no aggregate written\n"
            )
            return status
        return 0
    for number, (seed, command) in enumerate(zip(seeds, commands, strict=True), 1):
        print(f"{PROG}: seed {seed} ({number}/{len(seeds)})", flush=True)
        status = train.main(command)
        if status != 0:
            sys.stderr.write(
                f"{PROG}: error: seed {seed} failed (exit status {status}); no aggregate written\n"
            )
            return status
    return 0


def command_seeds(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """A training command's words split into the values it gives ``--seed`` (``--seed N``
    or ``--seed=N``, in order) and the other words."""
    given: list[str] = []
    rest: list[str] = []
    skip = False
    for index, word in enumerate(words):
        if skip:
            skip = False
        elif word == "--seed" and index + 1 < len(words):
            given.append(words[index + 1])
            skip = True
        elif word.startswith("--seed="):
            given.append(word.split("=", 1)[1])
        else:
            rest.append(word)
    return given, rest


def same_settings_but_seed(records: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The first way ``records`` (``--results`` JSONs by seed) were not trained alike: their
    training commands (``command``, as :func:`~engramrt_lab.models.train.training_command`
    writes it) must be the same once each one's ``--seed`` is taken out, and each must
    name its own seed; None when they were."""
    first: tuple[int, list[str]] | None = None
    for seed, record in sorted(records.items()):
        given, rest = command_seeds(shlex.split(str(record.get("command", ""))))
        allowed = ([], ["0"]) if seed == 0 else ([str(seed)],)  # 0 is the default
        if given not in allowed:
            return f"the record of seed {seed} was trained with --seed {' '.join(given) or 0}"
        if first is None:
            first = (seed, rest)
        elif rest != first[1]:
            return (
                f"seed {seed} was trained by {shlex.join(rest)!r} but seed {first[0]} by "
                f"{shlex.join(first[1])!r} (--seed aside); expected the same settings"
            )
    return None


def _write_aggregate(
    seeds: Sequence[int],
    out: Path,
    records: Mapping[int, Mapping[str, Any]],
    argv: Sequence[str] | None,
) -> int:
    """``seeds.json`` and ``seeds.md`` of ``records``, folded into every seed's model
    directory present (all of them after a run here; with ``--aggregate``, those that
    were copied in)."""
    problem = same_settings_but_seed(records)
    if problem is not None:
        sys.stderr.write(f"{PROG}: error: {problem}; no aggregate written\n")
        return 2
    summary = aggregate(records)
    summary["command"] = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    summary["records"] = {str(s): [p.name for p in _seed_records(out, s)] for s in seeds}
    artifacts.write_json(out / AGGREGATE_JSON, summary)
    atomic_write_bytes(out / SUMMARY_MD, markdown(summary).encode("utf-8"))
    for seed in seeds:
        directory = _seed_dir(out, seed)
        if (directory / artifacts.MODEL_JSON).is_file():
            fold_into_model_dir(directory, summary)
        else:
            print(f"{PROG}: seed {seed}: no model directory in {directory.name}, nothing folded")
    print(markdown(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
