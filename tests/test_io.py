from __future__ import annotations

import os

import pytest

from engramrt._io import atomic_write_bytes, atomic_writer


def test_atomic_write_replaces_and_sets_normal_mode(tmp_path) -> None:
    target = tmp_path / "out.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_failed_write_keeps_old_file_and_leaves_nothing(tmp_path) -> None:
    target = tmp_path / "out.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError), atomic_writer(target) as f:
        f.write(b"partial")
        raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
