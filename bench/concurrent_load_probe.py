"""Probe: load a checkpoint directory on tp ranks while another process keeps converting into it.

A converter process (a real process) alternates conversions of two sources,
A and B, into one directory. ``--tp`` rank processes (a gloo group, one per
tensor-parallel rank) each call :func:`load_tables` on that directory
``--loads`` times with ``group=`` (the ranks compare conversion ids before
reading, see :mod:`engramrt.checkpoint.ranks`), and every (rank, layer)'s rows
are compared with A's and B's. A load is *A* or *B* when every layer of every
rank matches that source, *mixed* when layers of both come back (within a
rank or across ranks), and *refused* when it raised a
:class:`~engramrt.errors.CheckpointError` (a clean refusal: the ranks could not
agree, or the set kept changing while it was being opened). Anything else (a
raw exception, rows of neither source) fails the probe.

    PYTHONPATH=src python bench/concurrent_load_probe.py --loads 5000 [--tp 2] [--out results.json]

Prints one JSON object; exits 1 when a load was mixed or failed otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engramrt.checkpoint import convert_checkpoint, load_tables
from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement

SOURCE = "engram.{layer}.weight"

CONVERTER = """
import sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from engramrt.checkpoint import convert_checkpoint
from engramrt.config import EngramConfig
config = EngramConfig.from_hf_dict(__import__("json").loads(Path(sys.argv[1]).read_text()))
sources, dst, stop, tp = sys.argv[2:4], sys.argv[4], Path(sys.argv[5]), int(sys.argv[6])
count = 0
print("ready", flush=True)
while not stop.exists():
    convert_checkpoint(sources[count % 2], dst, config, tp=tp)
    count += 1
print(count)
"""


def probe_config() -> EngramConfig:
    """Three layers of E = 64 with tiny primes: a few hundred rows per layer."""
    base = EngramConfig(
        layer_ids=(0, 2, 5),
        vocab_size=(37, 41),
        num_embeddings=(1, 1, 1),
        max_ngram_size=3,
        n_heads=2,
        head_dim=64,
        compressed_vocab_size=1000,
        pad_token_id=0,
        hidden_size=64,
        hc_mult=2,
        name="probe",
    )
    needed = EngramLayout(base, check_num_embeddings=False).num_embeddings
    return base.replace(num_embeddings=tuple(needed))


def write_source(path: Path, config: EngramConfig, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        SOURCE.format(layer=layer): torch.randn(rows, config.head_dim, generator=generator)
        for layer, rows in zip(config.layer_ids, config.num_embeddings, strict=True)
    }
    save_file(tensors, str(path))


def layer_digests(
    directory: Path, config: EngramConfig, tp: int, rank: int, group: Any = None
) -> list[str]:
    """sha256 of rank ``rank``'s packed rows of every layer as :func:`load_tables` serves them."""
    digests = []
    placement = TablePlacement("host", tp=tp, rank=rank)
    for store in load_tables(directory, config, placement, group=group):
        rows = store.gather_packed(torch.arange(store.num_rows))
        digests.append(hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest())
    return digests


def classify(got: list[str], expected: dict[str, list[str]]) -> str:
    """A, B, mixed (layers of both) or other (rows of neither) for every rank's digests."""
    sides = {
        "A" if d == a else "B" if d == b else "?"
        for d, a, b in zip(got, expected["A"], expected["B"], strict=True)
    }
    if sides in ({"A"}, {"B"}):
        return sides.pop()
    return "mixed" if sides == {"A", "B"} else "other"


def rank_process(
    rank: int, tp: int, root_name: str, loads: int, expected: dict[str, list[str]]
) -> None:
    """One tensor-parallel rank: ``loads`` loads with ``group=``; rank 0 counts them."""
    import torch.distributed as dist

    root = Path(root_name)
    try:
        warnings.simplefilter("ignore")  # the probe's tables record no token map
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root / 'init'}",
            rank=rank,
            world_size=tp,
            timeout=datetime.timedelta(seconds=300),
        )
        config = EngramConfig.from_hf_dict(json.loads((root / "config.json").read_text()))
        counts = {"A": 0, "B": 0, "mixed": 0, "refused": 0, "other": 0}
        examples: list[str] = []
        for _ in range(loads):
            outcome: Any
            try:
                outcome = layer_digests(root / "dst", config, tp, rank, dist.group.WORLD)
            except CheckpointError as exc:
                outcome = f"refused: {exc}"
            except Exception as exc:  # the probe counts what escapes
                outcome = f"other: {type(exc).__name__}: {exc}"
            gathered: list[Any] = [None] * tp
            dist.all_gather_object(gathered, outcome)
            if rank != 0:
                continue
            texts = [g for g in gathered if isinstance(g, str)]
            if any(t.startswith("other") for t in texts):
                counts["other"] += 1
                examples.append(texts[0])
            elif texts and len(texts) < tp:
                counts["other"] += 1  # refused on some ranks only: the ranks disagree
                examples.append(f"refused on {len(texts)} of {tp} ranks: {texts[0]}")
            elif texts:
                counts["refused"] += 1
                if len(examples) < 3:
                    examples.append(texts[0])
            else:
                kind = classify([d for g in gathered for d in g], expected)
                counts[kind] += 1
                if kind != "A" and kind != "B" and len(examples) < 6:
                    examples.append(f"a {kind} load")
        if rank == 0:
            (root / "counts.json").write_text(json.dumps({**counts, "examples": examples}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=5000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.loads < 1 or args.tp < 1:
        parser.error(f"--loads={args.loads} --tp={args.tp}; expected integers >= 1")
    config = probe_config()
    with tempfile.TemporaryDirectory(prefix="engramrt-probe-") as scratch:
        root = Path(scratch)
        (root / "config.json").write_text(json.dumps(config.to_hf_dict()))
        sources = [root / "a.safetensors", root / "b.safetensors"]
        for seed, source in enumerate(sources, start=1):
            write_source(source, config, seed)
        dst, stop = root / "dst", root / "stop"
        expected: dict[str, list[str]] = {}
        warnings.simplefilter("ignore")  # the probe's tables record no token map
        for label, source in zip("AB", sources, strict=True):
            convert_checkpoint(source, dst, config, tp=args.tp)
            expected[label] = [
                d for r in range(args.tp) for d in layer_digests(dst, config, args.tp, r)
            ]
        assert expected["A"] != expected["B"]
        src_root = Path(__file__).resolve().parents[1] / "src"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(src_root), os.environ.get("PYTHONPATH", "")]),
        }
        converter = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CONVERTER,
                str(root / "config.json"),
                *map(str, sources),
                str(dst),
                str(stop),
                str(args.tp),
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert converter.stdout is not None and converter.stdout.readline().strip() == "ready"
        context = multiprocessing.get_context("spawn")
        ranks = [
            context.Process(target=rank_process, args=(r, args.tp, str(root), args.loads, expected))
            for r in range(args.tp)
        ]
        began = time.monotonic()
        try:
            for process in ranks:
                process.start()
            for process in ranks:
                process.join()
        finally:
            stop.touch()
            conversions = converter.communicate(timeout=600)[0].strip()
        seconds = time.monotonic() - began
        errors = [p.read_text() for p in sorted(root.glob("error-*.txt"))]
        if errors or any(p.exitcode != 0 for p in ranks):
            raise SystemExit("a rank process failed:\n" + "\n".join(errors))
        if converter.returncode != 0:
            raise SystemExit(f"the converter process failed (exit {converter.returncode})")
        counts = json.loads((root / "counts.json").read_text())
        result = {
            "loads": args.loads,
            "tp": args.tp,
            "group": "gloo, one process per rank; load_tables(..., group=)",
            "rows_per_layer": list(config.num_embeddings),
            "conversions_meanwhile": int(conversions or 0),
            "seconds": round(seconds, 1),
            **counts,
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if result["mixed"] or result["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
