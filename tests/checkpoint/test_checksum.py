"""A content checksum per converted file: recorded at conversion, checked on load and by inspect.

The digest is recomputed here from the tensors as ``safetensors`` itself
reads them (not through engramrt's reader), by the definition in
:mod:`engramrt.checkpoint.safetensors_format`. A flipped data byte (the
header untouched) is refused by ``load_table(verify_checksums=True)`` and
by ``engramrt inspect --checkpoint`` (a real process), each naming the file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from engramrt.checkpoint import convert_checkpoint, load_table, read_header
from engramrt.checkpoint.safetensors_format import META_DATA_SHA256
from engramrt.errors import CheckpointError
from engramrt.lookup.tiers import TablePlacement

from .test_conversion_set import _source

ROOT = Path(__file__).resolve().parents[2]
HOST = TablePlacement("host", device="cpu")


def independent_digest(path: Path) -> str:
    header = read_header(path)
    combined = hashlib.sha256()
    with safe_open(str(path), framework="pt") as handle:
        for name in sorted(header.tensors, key=lambda n: header.tensors[n].begin):
            data = (
                handle.get_tensor(name).contiguous().view(-1).view(dtype=__import__("torch").uint8)
            )
            combined.update(name.encode() + b"\0" + hashlib.sha256(data.numpy().tobytes()).digest())
    return combined.hexdigest()


def flip_a_value_byte(path: Path) -> None:
    """XOR one byte of the first table's values with 0x01 (a finite code stays finite)."""
    header = read_header(path)
    entry = min(header.tensors.values(), key=lambda e: e.begin)
    offset = header.data_start + entry.begin + 17
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        flipped = byte ^ (0x02 if (byte ^ 0x01) & 0x7F == 0x7F else 0x01)
        handle.seek(offset)
        handle.write(bytes([flipped]))


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_files_record_their_content_digest(tmp_path, small, tp: int) -> None:
    src, _ = _source(tmp_path / "a.safetensors", small, 1)
    paths = convert_checkpoint(src, tmp_path / "dst", small, tp=tp)
    for path in paths:
        recorded = read_header(path).metadata[META_DATA_SHA256]
        assert recorded == independent_digest(path) and len(recorded) == 64
    # Control: the digest depends on the bytes.
    flip_a_value_byte(paths[0])
    assert read_header(paths[0]).metadata[META_DATA_SHA256] != independent_digest(paths[0])


def test_a_flipped_byte_is_refused_on_a_verified_load(tmp_path, small) -> None:
    src, _ = _source(tmp_path / "a.safetensors", small, 1)
    (path,) = convert_checkpoint(src, tmp_path / "dst", small)
    load_table(tmp_path / "dst", small, 0, HOST, verify_checksums=True)
    flip_a_value_byte(path)
    with pytest.raises(
        CheckpointError, match=rf"{path}: its content checksum is [0-9a-f]{{64}} but"
    ):
        load_table(tmp_path / "dst", small, 0, HOST, verify_checksums=True)
    # Off by default (a whole-file read): the unverified load serves the changed bytes.
    load_table(tmp_path / "dst", small, 0, HOST)


def _inspect(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "engramrt.cli", "inspect", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_inspect_checks_every_files_checksum(tmp_path, tiny) -> None:
    """The tiny preset (its layout fits the DeepSeek-V4 token map that inspect loads)."""
    import json

    src, _ = _source(tmp_path / "a.safetensors", tiny, 1)
    paths = convert_checkpoint(src, tmp_path / "dst", tiny, tp=2)
    done = _inspect("-c", "tiny", "--checkpoint", str(tmp_path / "dst"), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    files = json.loads(done.stdout)["checkpoint_files"]
    assert [f["file"] for f in files] == [p.name for p in paths]
    assert all(
        f["checked"] and f["data_sha256"] == independent_digest(p)
        for f, p in zip(files, paths, strict=True)
    )
    flip_a_value_byte(paths[1])
    done = _inspect("-c", "tiny", "--checkpoint", str(tmp_path / "dst"))
    assert (done.returncode == 2 and done.stdout == "") or "error:" in done.stderr
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert (
        lines[0].startswith("error:")
        and paths[1].name in lines[0]
        and "content checksum" in lines[0]
    )
