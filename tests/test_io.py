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


def _tree(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_staged_directory_replaces_the_target_whole(tmp_path, monkeypatch, exchange) -> None:
    from engramrt import _io

    if not exchange:
        monkeypatch.setattr(_io, "_exchange", lambda first, second: False)
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    with _io.staged_directory(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".model.staging-")
        assert _tree(target) == {"old.bin": b"old"}  # untouched while the block runs
        (staging / "new.bin").write_bytes(b"new")
    assert _tree(target) == {"new.bin": b"new"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging, no old copy
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_failed_staged_directory_leaves_the_target_and_nothing_else(tmp_path) -> None:
    from engramrt._io import staged_directory

    target = tmp_path / "model"
    target.mkdir()
    (target / "model.bin").write_bytes(b"complete")
    with pytest.raises(OSError, match="No space"), staged_directory(target) as staging:
        (staging / "model.bin").write_bytes(b"part")
        raise OSError(28, "No space left on device")
    assert _tree(target) == {"model.bin": b"complete"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    with staged_directory(tmp_path / "new") as staging:  # a target that did not exist
        (staging / "a").write_bytes(b"a")
    assert _tree(tmp_path / "new") == {"a": b"a"}


def test_a_killed_writers_stage_is_removed_and_a_live_one_kept(tmp_path) -> None:
    import fcntl

    from engramrt._io import remove_abandoned_stages, staged_directory

    target = tmp_path / "model"
    dead = tmp_path / ".model.staging-dead"
    live = tmp_path / ".model.staging-live"
    for stage in (dead, live):
        stage.mkdir()
        (stage / "engram.safetensors").write_bytes(b"half")
        (tmp_path / f"{stage.name}.lock").touch()
    holder = os.open(tmp_path / f"{live.name}.lock", os.O_RDONLY)  # a running writer's lock
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert remove_abandoned_stages(target) == [dead]
        with staged_directory(target) as staging:
            (staging / "x").write_bytes(b"x")
        assert live.is_dir() and not dead.exists()
        assert not (tmp_path / f"{dead.name}.lock").exists()
    finally:
        os.close(holder)
    assert remove_abandoned_stages(target) == [live]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_block_may_lock_the_staging_directory_itself(tmp_path) -> None:
    """A conversion into the staging directory takes an flock on the directory; the
    staging's own lock is elsewhere, so the two never wait on each other."""
    import fcntl

    from engramrt._io import staged_directory

    with staged_directory(tmp_path / "model") as staging:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if already held
        finally:
            os.close(fd)
