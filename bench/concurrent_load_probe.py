"""Probe: load a checkpoint directory while another process keeps converting into it.

A converter process (a real process) alternates conversions of two sources,
A and B, into one directory; this process calls :func:`load_tables` on that
directory ``--loads`` times and compares every layer's rows with A's and
B's. A load is *A* or *B* when every layer matches that source, *mixed*
when layers of both come back, and *refused* when it raised a
:class:`~engramrt.errors.CheckpointError` (a clean refusal: the set kept
changing while it was being opened). Anything else (a raw exception, rows
of neither source) fails the probe.

    PYTHONPATH=src python bench/concurrent_load_probe.py --loads 5000 [--tp 2] [--out results.json]

Prints one JSON object; exits 1 when a load was mixed or failed otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

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


def layer_digests(directory: Path, config: EngramConfig, tp: int) -> list[str]:
    """sha256 of every (rank, layer)'s packed rows as :func:`load_tables` serves them."""
    digests = []
    for rank in range(tp):
        for store in load_tables(directory, config, TablePlacement("host", tp=tp, rank=rank)):
            rows = store.gather_packed(torch.arange(store.num_rows))
            digests.append(hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest())
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=5000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    config = probe_config()
    with tempfile.TemporaryDirectory(prefix="engramrt-probe-") as scratch:
        root = Path(scratch)
        (root / "config.json").write_text(json.dumps(config.to_hf_dict()))
        sources = [root / "a.safetensors", root / "b.safetensors"]
        for seed, source in enumerate(sources, start=1):
            write_source(source, config, seed)
        dst, stop = root / "dst", root / "stop"
        expected = {}
        for label, source in zip("AB", sources, strict=True):
            convert_checkpoint(source, dst, config, tp=args.tp)
            expected[label] = layer_digests(dst, config, args.tp)
        assert expected["A"] != expected["B"]
        src_root = Path(__file__).resolve().parents[1] / "src"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(src_root), os.environ.get("PYTHONPATH", "")]),
        }
        warnings.simplefilter("ignore")  # the probe's tables record no token map
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
        counts = {"A": 0, "B": 0, "mixed": 0, "refused": 0, "other": 0}
        examples: list[str] = []
        began = time.monotonic()
        try:
            for _ in range(args.loads):
                try:
                    got = layer_digests(dst, config, args.tp)
                except CheckpointError as exc:
                    counts["refused"] += 1
                    if len(examples) < 3:
                        examples.append(f"refused: {exc}")
                    continue
                except Exception as exc:  # the probe counts what escapes
                    counts["other"] += 1
                    examples.append(f"{type(exc).__name__}: {exc}")
                    continue
                sides = {
                    "A" if d == a else "B" if d == b else "?"
                    for d, a, b in zip(got, expected["A"], expected["B"], strict=True)
                }
                if sides in ({"A"}, {"B"}):
                    counts[sides.pop()] += 1
                else:
                    counts["mixed" if sides == {"A", "B"} else "other"] += 1
                    if len(examples) < 6:
                        examples.append(f"layers from {sorted(sides)}")
        finally:
            stop.touch()
            conversions = converter.communicate(timeout=600)[0].strip()
        if converter.returncode != 0:
            raise SystemExit(f"the converter process failed (exit {converter.returncode})")
        result = {
            "loads": args.loads,
            "tp": args.tp,
            "rows_per_layer": list(config.num_embeddings),
            "conversions_meanwhile": int(conversions or 0),
            "seconds": round(time.monotonic() - began, 1),
            **counts,
            "examples": examples,
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if counts["mixed"] or counts["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
