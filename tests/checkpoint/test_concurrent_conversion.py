"""A load holds the set it resolved while other processes convert into the same directory.

``SafetensorsCheckpoint`` opens the files of its set once; a conversion
committing meanwhile (a real ``engramrt convert`` process) renames new
files over the old names, and every later read of that checkpoint still
returns the old set: never layer 0 of one conversion and layer 2 of the
next. A second test runs a converter process alternating two sources into
the directory while this process loads, and counts the loads of each set
(``bench/concurrent_load_probe.py`` is the long version of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engramrt.checkpoint import SafetensorsCheckpoint, convert_checkpoint, read_table
from engramrt.errors import CheckpointError

from .conftest import float_tables, reference_packed
from .test_conversion_set import _rank_rows, _source

ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "engramrt.cli")


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def _convert_cli(src: Path, dst: Path, config_file: Path, tp: int) -> None:
    done = subprocess.run(
        [*CLI, "convert", str(src), str(dst), "-c", str(config_file), "--tp", str(tp), "-q"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_checkpoint_keeps_reading_the_set_it_opened(tmp_path, small, tp: int) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(small.to_hf_dict()))
    src_a, packed_a = _source(tmp_path / "a.safetensors", small, 1)
    src_b, packed_b = _source(tmp_path / "b.safetensors", small, 2)
    dst = tmp_path / "dst"
    convert_checkpoint(src_a, dst, small, tp=tp)
    rank = tp - 1
    want_a, want_b = _rank_rows(small, packed_a, tp, rank), _rank_rows(small, packed_b, tp, rank)
    assert all(not torch.equal(a, b) for a, b in zip(want_a, want_b, strict=True))
    with SafetensorsCheckpoint(dst) as held:
        first = read_table(held, small, 0, tp=tp, rank=rank)
        _convert_cli(src_b, dst, config_file, tp)  # commits B over A's names meanwhile
        later = [read_table(held, small, i, tp=tp, rank=rank) for i in (1, 2)]
    got = [first, *later]
    assert all(torch.equal(g, w) for g, w in zip(got, want_a, strict=True)), "a mixed set"
    # A checkpoint opened afterwards reads B, so the check above can tell them apart.
    reopened = [read_table(dst, small, i, tp=tp, rank=rank) for i in range(3)]
    assert all(torch.equal(g, w) for g, w in zip(reopened, want_b, strict=True))


CONVERTER = """
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from engramrt.checkpoint import convert_checkpoint
from engramrt.config import EngramConfig
config = EngramConfig.from_hf_dict(json.loads(Path(sys.argv[1]).read_text()))
sources, dst, stop = sys.argv[2:4], sys.argv[4], Path(sys.argv[5])
count = 0
print("ready", flush=True)
while not stop.exists():
    convert_checkpoint(sources[count % 2], dst, config)
    count += 1
print(count)
"""


def test_loads_during_alternating_conversions_are_never_mixed(tmp_path, small) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(small.to_hf_dict()))
    sources, wants = [], []
    for seed in (1, 2):
        src, packed = _source(tmp_path / f"{seed}.safetensors", small, seed)
        sources.append(src)
        wants.append(packed)
    dst, stop = tmp_path / "dst", tmp_path / "stop"
    convert_checkpoint(sources[0], dst, small)
    converter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CONVERTER,
            str(config_file),
            *map(str, sources),
            str(dst),
            str(stop),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    counts = {"A": 0, "B": 0, "refused": 0}
    mixed = []
    try:
        assert converter.stdout is not None and converter.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            try:
                with SafetensorsCheckpoint(dst) as held:
                    got = [read_table(held, small, i) for i in range(small.n_layers)]
            except CheckpointError:
                counts["refused"] += 1
                continue
            sides = {
                "A" if torch.equal(g, a) else "B" if torch.equal(g, b) else "?"
                for g, a, b in zip(got, wants[0], wants[1], strict=True)
            }
            if len(sides) == 1 and "?" not in sides:
                counts[sides.pop()] += 1
            else:
                mixed.append(sorted(sides))
    finally:
        stop.touch()
        conversions = int(converter.communicate(timeout=120)[0].split()[-1])
    assert converter.returncode == 0
    assert mixed == [], f"{len(mixed)} mixed loads: {mixed[:5]} ({counts})"
    assert conversions >= 2 and counts["A"] + counts["B"] > 0, (conversions, counts)


def test_a_broken_directory_is_refused_without_retrying_for_ever(tmp_path, small) -> None:
    """A set that is wrong (not changing) is reported as such at once."""
    tables = float_tables(small, seed=3)
    src, _ = tmp_path / "s.safetensors", reference_packed(tables)
    _source(src, small, 3)
    dst = tmp_path / "dst"
    convert_checkpoint(src, dst, small, tp=2)
    (dst / "engram-rank1-of-2.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"engram-rank1-of-2\.safetensors is missing"):
        SafetensorsCheckpoint(dst)


def test_a_pickled_checkpoint_reopens_by_path(tmp_path, small) -> None:
    """Held descriptors do not travel: a copy (another process's) opens the files itself."""
    import pickle

    src, packed = _source(tmp_path / "a.safetensors", small, 1)
    convert_checkpoint(src, tmp_path / "dst", small)
    held = SafetensorsCheckpoint(tmp_path / "dst")
    copy = pickle.loads(pickle.dumps(held))
    held.close()
    assert copy._held == {}
    assert torch.equal(read_table(copy, small, 1), packed[1])
    copy.close()
