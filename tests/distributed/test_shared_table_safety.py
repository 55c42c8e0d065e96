"""Shared tables against other users, the umask, full disks and killed creators.

Ownership: a table whose files belong to another uid is refused unless that
uid is trusted. Modes: never group/world-writable, whatever the umask.
Space: a preflight names the bytes, the directory and ``--shm-size``; a full
file system at the manifest write leaves no orphan. Crashes: a real creator
process is SIGKILLed at each step of the publication (``ENGRAMRT_TEST_KILL_AT``)
and the next caller gets exactly the right rows, with no leftover.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.distributed.common import CountingLoader, sha256_of
from tests.helpers import finite_packed_table

from engramrt.distributed import SharedHostTable, TablePaths
from engramrt.distributed import shared_table as shared_table_module
from engramrt.errors import CapacityError, UntrustedFileError

ROOT = Path(__file__).resolve().parents[2]
NUM_ROWS, E = 500, 64
ROW_BYTES = E + E // 32
NAME = "table"
OTHER_UID = 54321


@pytest.fixture
def rows() -> torch.Tensor:
    return finite_packed_table(NUM_ROWS, E, seed=9)


def build(directory: Path, loader, **options) -> SharedHostTable:
    return SharedHostTable.create_or_attach(
        NAME, NUM_ROWS, ROW_BYTES, loader, directory=directory, timeout_s=30, **options
    )


def leftovers(directory: Path) -> list[str]:
    """Files other than a published table's data, manifest and lock."""
    paths = TablePaths(directory, NAME)
    keep = {paths.data.name, paths.manifest.name, paths.lock.name}
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# --- ownership -------------------------------------------------------------------------


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@needs_root
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_a_table_of_another_user_is_refused(tmp_path: Path, rows, which, monkeypatch) -> None:
    monkeypatch.delenv(shared_table_module.TRUSTED_UIDS_ENV, raising=False)
    build(tmp_path, CountingLoader(rows))
    paths = TablePaths(tmp_path, NAME)
    os.chown(getattr(paths, which), OTHER_UID, -1)
    loader = CountingLoader(rows)
    with pytest.raises(UntrustedFileError, match=rf"belongs to uid {OTHER_UID}; expected one of"):
        build(tmp_path, loader)
    assert loader.calls == 0
    with pytest.raises(UntrustedFileError, match=str(OTHER_UID)):
        SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path)
    # Trusted by argument, or by the environment: attached, the loader never runs.
    table = build(tmp_path, loader, trusted_uids=[OTHER_UID])
    assert table.shared and not table.created and loader.calls == 0
    monkeypatch.setenv(shared_table_module.TRUSTED_UIDS_ENV, f"7, {OTHER_UID}")
    assert SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path).shared


def test_a_world_writable_table_is_refused(tmp_path: Path, rows) -> None:
    build(tmp_path, CountingLoader(rows))
    paths = TablePaths(tmp_path, NAME)
    os.chmod(paths.manifest, 0o666)
    with pytest.raises(UntrustedFileError, match=r"mode 0o666, writable by group or others"):
        SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path)


def test_bad_trusted_uids_variable(tmp_path: Path, rows, monkeypatch) -> None:
    monkeypatch.setenv(shared_table_module.TRUSTED_UIDS_ENV, "1000,bob")
    with pytest.raises(Exception, match=r"ENGRAMRT_SHARED_TRUSTED_UIDS='1000,bob': 'bob'"):
        build(tmp_path, CountingLoader(rows))


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o022])
def test_modes_do_not_follow_the_umask(tmp_path: Path, rows, umask: int) -> None:
    previous = os.umask(umask)
    try:
        table = build(tmp_path, CountingLoader(rows))
    finally:
        os.umask(previous)
    assert table.created
    paths = TablePaths(tmp_path, NAME)
    modes = {
        p.name: stat.S_IMODE(p.stat().st_mode) for p in (paths.data, paths.manifest, paths.lock)
    }
    assert modes == {paths.data.name: 0o444, paths.manifest.name: 0o444, paths.lock.name: 0o644}
    assert leftovers(tmp_path) == []


# --- space ------------------------------------------------------------------------------


def test_preflight_names_bytes_directory_and_shm_size(tmp_path: Path, rows, monkeypatch) -> None:
    monkeypatch.setattr(shared_table_module, "free_bytes", lambda path: 1000)
    loader = CountingLoader(rows)
    nbytes = NUM_ROWS * ROW_BYTES
    with pytest.raises(
        CapacityError,
        match=rf"need {nbytes} bytes|needs {nbytes} bytes .* {tmp_path} but it has 1000 bytes .*"
        r"--shm-size",
    ) as info:
        build(tmp_path, loader, private_fallback=False)
    assert "--shm-size" in str(info.value) and str(tmp_path) in str(info.value)
    assert loader.calls == 0 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("private_fallback", [False, True])
def test_full_disk_at_the_manifest_leaves_no_orphan(
    tmp_path: Path, rows, monkeypatch, private_fallback: bool
) -> None:
    def full(path, data, mode=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(shared_table_module, "atomic_write_bytes", full)
    loader = CountingLoader(rows)
    if private_fallback:
        with pytest.warns(
            UserWarning, match=r"writing the manifest .* failed \(No space left .*--shm-size"
        ):
            table = build(tmp_path, loader)
        assert not table.shared and sha256_of(table.rows) == sha256_of(rows)
    else:
        with pytest.raises(
            CapacityError, match=r"writing the manifest .* failed \(No space left .*--shm-size"
        ):
            build(tmp_path, loader, private_fallback=False)
    paths = TablePaths(tmp_path, NAME)
    assert not paths.data.exists() and not paths.manifest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths.lock.name]


def test_stale_manifest_temporaries_are_removed(tmp_path: Path, rows) -> None:
    stale = tmp_path / f".{NAME}.manifest.json.abc123.tmp"
    stale.write_text("{")
    build(tmp_path, CountingLoader(rows))
    assert not stale.exists() and leftovers(tmp_path) == []


# --- a real creator SIGKILLed at each step -------------------------------------------------

CREATOR = """
import sys, torch
from engramrt.distributed import SharedHostTable
from tests.helpers import finite_packed_table
rows = finite_packed_table({num_rows}, {E}, seed=9)
SharedHostTable.create_or_attach(
    {name!r}, {num_rows}, {row_bytes}, lambda t: t.copy_(rows), directory=sys.argv[1], timeout_s=30
)
print("published")
"""

# (kill point, whether the table is already published when the creator dies)
POINTS = [
    ("shared:reserved", False),
    ("shared:loaded", False),
    ("shared:renamed", False),
    ("shared:published", True),
]


@pytest.mark.parametrize(("point", "published"), POINTS)
def test_a_creator_killed_at_each_step(tmp_path: Path, rows, point: str, published: bool) -> None:
    script = CREATOR.format(num_rows=NUM_ROWS, E=E, name=NAME, row_bytes=ROW_BYTES)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    env[shared_table_module.KILL_ENV] = point
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    loader = CountingLoader(rows)
    table = build(tmp_path, loader)
    assert sha256_of(table.rows) == sha256_of(rows)
    assert loader.calls == (0 if published else 1) and table.created is not published
    assert leftovers(tmp_path) == []
    # A killed creator's leftovers never attach: a wrong table is not served either.
    assert SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path).shared
