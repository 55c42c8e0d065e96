"""Where the memory wins: each model's held-out loss by what training saw.

::

    python bench/where_it_wins.py --model DIR --device cuda --out where.json

or in two halves, the corpus where it was trained and the models anywhere::

    python bench/where_it_wins.py --model DIR --save-masks masks.npz   # the corpus' machine
    python bench/where_it_wins.py --model DIR --masks masks.npz --device cpu --out where.json

Rebuilds the training corpus of ``DIR``'s record on this machine (the same
rule; the manifest is compared with the record and every difference
printed; a run given ``--stdlib-root`` or ``--site-dirs`` records their
names only, so give them here too), the windows the models trained on (the one-pass order of the
recorded seed, steps and batch size) and the held-out sequences; splits
every held-out prediction by whether its n-grams were seen in those windows
(:mod:`engramrt_lab.models.wins`), and reports the share of predictions and
each model's mean loss per category: the Engram model on its fp8 tables
(``engram_fp8``), ``baseline`` and ``baseline_wide``; beside them the Engram
model's mean gate per category and Engram block (the gate of the position a
prediction is made from, averaged over the streams: how much of the memory's
value it let in, where the context was seen and where not). As a check, each
model's mean over all predictions must equal the held-out loss that
``model.json`` records (relative 2e-3: the shipped weights are bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _source_roots(
    settings: dict, stdlib_root: Path | None, site_dirs: list[Path] | None
) -> tuple[Path | None, list[Path] | None]:
    """Where the record's source directories are here: the flags, else the interpreter's
    when the run read the interpreter's (recorded as null). A record names a directory the
    run was given by its name only, so such a run needs the flag."""
    recorded_root, recorded_sites = settings.get("stdlib_root"), settings.get("site_dirs")
    if stdlib_root is None and recorded_root is not None:
        raise SystemExit(
            f"error: the run read a stdlib root named {recorded_root!r}; give --stdlib-root "
            f"(where it is on this machine)"
        )
    if site_dirs is None and recorded_sites is not None:
        raise SystemExit(
            f"error: the run read the site directories {recorded_sites!r}; give --site-dirs "
            f"(where they are on this machine, comma-separated; '' for none)"
        )
    return stdlib_root, site_dirs


def _corpus_masks(
    data: dict, settings: dict, record: dict, roots: tuple[Path | None, list[Path] | None]
) -> tuple[Any, ...]:
    """The corpus part: manifest differences, trained windows, held-out arrays, masks."""
    from engramrt.config import EngramConfig
    from engramrt.tokenmap import load_tokenizer
    from engramrt_lab.models.corpus import build_corpus, eval_segments, manifest_differences
    from engramrt_lab.models.train import OnePassWindows
    from engramrt_lab.models.wins import category_masks, training_ngrams

    root, sites = roots
    corpus = build_corpus(
        load_tokenizer(),
        max_files=settings.get("max_files"),
        max_train_chars=settings.get("max_train_chars"),
        root=root,
        sites=sites,
    )
    diffs = manifest_differences(record["corpus"], corpus.record())
    print("corpus: the recorded one" if not diffs else "corpus differs: " + "; ".join(diffs))
    seq, batch = settings["seq_len"], settings["batch_size"]
    steps = record["engram"]["steps"]
    windows = OnePassWindows(
        corpus.train.num_tokens, seq, batch, settings["seed"], torch.device("cpu")
    )
    used = windows.order[: steps * batch].numpy() * seq
    seen = training_ngrams(corpus.train.tokens[used[:, None] + np.arange(seq + 1)])
    n = EngramConfig.from_hf_dict(data["engram"]).max_ngram_size
    segments = eval_segments(corpus.heldout, seq, settings["eval_sequences"], n)
    masks = category_masks(segments.tokens, segments.lengths, segments.lookback, seen)
    arrays = (segments.tokens, segments.lengths, segments.lookback, segments.positions)
    return diffs, int(used.size), arrays, masks


def main(argv: list[str] | None = None) -> int:
    from engramrt.hashing import HashConstants
    from engramrt.lookup.tiers import TablePlacement
    from engramrt_lab.models import artifacts
    from engramrt_lab.models.corpus import EvalSegments
    from engramrt_lab.models.lm import LMConfig, TinyLM
    from engramrt_lab.models.serve import load_model
    from engramrt_lab.models.train import segment_row_ids, token_losses, token_losses_and_gates
    from engramrt_lab.models.wins import category_losses

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--save-masks", type=Path, default=None)
    parser.add_argument("--masks", type=Path, default=None)
    parser.add_argument(
        "--stdlib-root",
        type=Path,
        default=None,
        help="where the run's stdlib root is here (needed when the run was given one)",
    )
    parser.add_argument(
        "--site-dirs",
        type=lambda text: [Path(p) for p in text.split(",") if p],
        default=None,
        help="where the run's site directories are here, comma-separated (needed when the "
        "run was given them)",
    )
    args = parser.parse_args(argv)
    began = time.perf_counter()
    device = torch.device(args.device)
    data = artifacts.read_model_json(args.model)
    record = data["training"]
    settings = record["settings"]
    if args.masks is not None:
        saved = np.load(args.masks, allow_pickle=False)
        meta = json.loads(str(saved["meta"]))
        diffs, used_count = meta["corpus_differences"], meta["trained_windows"]
        segments_arrays = tuple(saved[k] for k in ("tokens", "lengths", "lookback", "positions"))
        masks = {
            view: {cat: saved[f"{view}/{cat}"] for cat in cats}
            for view, cats in meta["categories"].items()
        }
    else:
        roots = _source_roots(settings, args.stdlib_root, args.site_dirs)
        diffs, used_count, segments_arrays, masks = _corpus_masks(data, settings, record, roots)
        if args.save_masks is not None:
            flat = {f"{v}/{c}": m for v, cats in masks.items() for c, m in cats.items()}
            meta = {
                "corpus_differences": diffs,
                "trained_windows": used_count,
                "categories": {v: list(cats) for v, cats in masks.items()},
            }
            np.savez_compressed(
                args.save_masks,
                tokens=segments_arrays[0],
                lengths=segments_arrays[1],
                lookback=segments_arrays[2],
                positions=segments_arrays[3],
                meta=np.array(json.dumps(meta)),
                **flat,
            )
            print(f"masks written: {args.save_masks} ({time.perf_counter() - began:.1f} s)")
            return 0
    model = load_model(args.model, TablePlacement("device", device), load_baseline=True)
    tokens_np, lengths_np, lookback_np, positions_np = segments_arrays
    segments = EvalSegments(
        tokens_np, lengths_np, lookback_np, np.zeros_like(lengths_np), positions_np
    )
    trim = torch.as_tensor(np.array(model.vocab.trim_map), device=device)
    tokens = trim[torch.as_tensor(segments.tokens, device=device)]
    lengths = torch.as_tensor(segments.lengths, device=device)
    consts = HashConstants.from_config(model.config, model.token_map)
    ids = segment_row_ids(segments, consts, torch.as_tensor(np.array(model.token_map.map)), device)
    wide = TinyLM(LMConfig.from_dict(data["baseline_wide_lm"]))
    artifacts.load_weights(artifacts.model_file(args.model, data, "baseline_wide_weights"), wide)
    stores = model.stores
    assert model.baseline is not None
    engram_losses, engram_gates = token_losses_and_gates(
        model.lm, lambda index, rows: stores[index].lookup(rows).float(), tokens, lengths, ids
    )
    losses = {
        "engram_fp8": engram_losses,
        "baseline": token_losses(model.baseline, None, tokens, lengths, None),
        "baseline_wide": token_losses(wide.to(device).float(), None, tokens, lengths, None),
    }
    recorded = record["heldout"]["losses"]
    checks = {}
    for name, values in losses.items():
        mean = float(np.nanmean(values))
        checks[name] = {
            "mean": mean,
            "recorded": recorded[name],
            "agrees": abs(mean - recorded[name]) / recorded[name] < 2e-3,
        }
    table = category_losses(masks, losses, {"engram_fp8": engram_gates})
    result: dict[str, Any] = {
        "model": str(args.model),
        "device": str(device),
        "corpus_differences": diffs,
        "trained_windows": int(used_count),
        "heldout_predictions": segments.num_predictions,
        "checks": checks,
        "categories": table,
        "seconds": round(time.perf_counter() - began, 1),
    }
    for view, rows in table.items():
        columns = [c for c in next(iter(rows.values())) if c not in ("predictions", "share")]
        print(f"\n{view}:")
        print("| category | share | " + " | ".join(columns) + " |")
        for cat, row in rows.items():
            cells = " | ".join(f"{row[m]:.4f}" if row[m] is not None else "-" for m in columns)
            print(f"| {cat} | {row['share']:.1%} | {cells} |")
    print(f"\nchecks: {checks}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(c["agrees"] for c in checks.values()) and not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
