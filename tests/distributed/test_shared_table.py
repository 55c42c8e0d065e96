"""The shared host table's publication protocol, in this process (plus one crashing creator).

Every leftover a crashed or interrupted creator can leave (a tmp file, a
data file without manifest, a manifest that is not complete, describes
another file, was altered, or whose rows were altered) is never attached:
the next caller loads the table again (the loader runs exactly once more)
and removes the leftovers. Processes that cannot share fall back to a
private copy with a warning that gives the numbers.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.distributed import crash_worker
from tests.distributed.common import CountingLoader, sha256_of
from tests.distributed.world_worker import mapping_permissions
from tests.helpers import finite_packed_table

from engramrt.distributed import (
    SharedHostTable,
    SharingRequest,
    TablePaths,
    clean_stale_tmp_files,
    decide_sharing,
)
from engramrt.distributed import shared_table as shared_table_module
from engramrt.errors import CapacityError, ValidationError

NUM_ROWS, E = 1000, 64
ROW_BYTES = E + E // 32
NAME = "table"


def dead_pid() -> int:
    """A pid no process has: pids are below ``pid_max``."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


@pytest.fixture
def rows() -> torch.Tensor:
    return finite_packed_table(NUM_ROWS, E, seed=5)


@pytest.fixture
def loader(rows: torch.Tensor) -> CountingLoader:
    return CountingLoader(rows)


def build(directory: Path, loader: Callable[[torch.Tensor], None], **options) -> SharedHostTable:
    return SharedHostTable.create_or_attach(
        NAME, NUM_ROWS, ROW_BYTES, loader, directory=directory, timeout_s=10, **options
    )


def assert_published(directory: Path, table: SharedHostTable, rows: torch.Tensor) -> None:
    paths = TablePaths(directory, NAME)
    assert table.shared and table.path == paths.data
    assert sha256_of(table.rows) == sha256_of(rows)
    assert mapping_permissions(table.path, table.rows.data_ptr()) == "r--s"
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["complete"] is True and manifest["nbytes"] == NUM_ROWS * ROW_BYTES
    assert paths.tmp_files() == []
    assert stat.S_IMODE(paths.data.stat().st_mode) == 0o444


# --- publication and attaching ---------------------------------------------------


def test_second_call_attaches_without_loading(tmp_path: Path, rows, loader) -> None:
    first = build(tmp_path, loader)
    assert first.created and loader.calls == 1
    assert_published(tmp_path, first, rows)
    second = build(tmp_path, loader)
    assert not second.created and loader.calls == 1
    assert_published(tmp_path, second, rows)
    attached = SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path)
    assert sha256_of(attached.rows) == sha256_of(rows)


def test_empty_table(tmp_path: Path) -> None:
    table = SharedHostTable.create_or_attach(
        "empty", 0, ROW_BYTES, lambda target: None, directory=tmp_path
    )
    assert table.rows.shape == (0, ROW_BYTES) and table.shared
    again = SharedHostTable.create_or_attach(
        "empty", 0, ROW_BYTES, lambda target: None, directory=tmp_path
    )
    assert not again.created


def break_table(directory: Path, kind: str, rows: torch.Tensor) -> None:
    """Leave what a creator that crashed (or someone else) could leave behind."""
    paths = TablePaths(directory, NAME)
    garbage = torch.randint(0, 256, (NUM_ROWS, ROW_BYTES), dtype=torch.uint8).numpy().tobytes()
    if kind == "tmp file only":  # died while loading
        paths.tmp(dead_pid()).write_bytes(garbage)
        return
    if kind == "data without manifest":  # died between the rename and the manifest
        paths.tmp(dead_pid()).write_bytes(garbage[:100])
        paths.data.write_bytes(garbage)
        return
    build(directory, CountingLoader(rows))  # a good table, then damage it
    manifest = json.loads(paths.manifest.read_text())
    if kind == "manifest not complete":
        manifest["complete"] = False
        fields = {k: v for k, v in manifest.items() if k != "metadata_sha256"}
        manifest["metadata_sha256"] = shared_table_module._metadata_digest(fields)
        paths.manifest.write_text(json.dumps(manifest))
    elif kind == "manifest altered":
        manifest["num_rows"] = NUM_ROWS  # same values, but the sample digest changed:
        manifest["sha256"] = "0" * 64  # its own checksum no longer verifies
        paths.manifest.write_text(json.dumps(manifest))
    elif kind == "data file replaced":  # same size, another inode
        paths.data.unlink()
        paths.data.write_bytes(garbage)
    elif kind == "sampled row altered":
        os.chmod(paths.data, 0o644)
        with open(paths.data, "r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 0xFF]))
    else:
        raise AssertionError(kind)


LEFTOVERS = [
    "tmp file only",
    "data without manifest",
    "manifest not complete",
    "manifest altered",
    "data file replaced",
    "sampled row altered",
]


@pytest.mark.parametrize("kind", LEFTOVERS)
def test_leftovers_are_never_attached_and_are_replaced(
    tmp_path: Path, rows, loader, kind: str
) -> None:
    break_table(tmp_path, kind, rows)
    with pytest.raises(ValidationError, match="no complete table"):
        SharedHostTable.attach(NAME, NUM_ROWS, ROW_BYTES, directory=tmp_path)
    table = build(tmp_path, loader)
    assert table.created and loader.calls == 1  # loaded again, not attached
    assert_published(tmp_path, table, rows)


def test_sample_checksum_misses_an_unsampled_row_but_full_catches_it(
    tmp_path: Path, rows, loader
) -> None:
    """Negative control of the sample checksum: it only sees the sampled rows."""
    for checksum in ("sample", "full"):
        directory = tmp_path / checksum
        build(directory, CountingLoader(rows), checksum=checksum)
        data = TablePaths(directory, NAME).data
        unsampled = 1  # rows 0, 15, 31, ... are sampled (64 of 1000)
        assert unsampled not in shared_table_module._sample_indices(NUM_ROWS)
        os.chmod(data, 0o644)
        with open(data, "r+b") as handle:
            handle.seek(unsampled * ROW_BYTES)
            handle.write(b"\x00\x01\x02")
        loader = CountingLoader(rows)
        table = build(directory, loader, checksum=checksum)
        assert loader.calls == (0 if checksum == "sample" else 1)
        assert (sha256_of(table.rows) == sha256_of(rows)) == (checksum == "full")


def test_a_table_of_another_geometry_is_refused_or_replaced(tmp_path: Path, rows, loader) -> None:
    build(tmp_path, loader, fingerprint="checkpoint A")
    with pytest.raises(ValidationError, match=r"holds another table.*checkpoint A.*checkpoint B"):
        build(tmp_path, loader, fingerprint="checkpoint B")
    with pytest.raises(ValidationError, match=r"'num_rows': 1000.*'num_rows': 999"):
        SharedHostTable.create_or_attach(
            NAME, 999, ROW_BYTES, loader, directory=tmp_path, fingerprint="checkpoint A"
        )
    table = build(tmp_path, loader, fingerprint="checkpoint B", replace_mismatched=True)
    assert table.created and loader.calls == 2
    assert table.manifest is not None and table.manifest["fingerprint"] == "checkpoint B"


def test_a_failing_loader_leaves_nothing_behind(tmp_path: Path, rows, loader) -> None:
    def broken(target: torch.Tensor) -> None:
        target[:10] = 1
        raise RuntimeError("checkpoint unreadable")

    with pytest.raises(RuntimeError, match="checkpoint unreadable"):
        build(tmp_path, broken)
    paths = TablePaths(tmp_path, NAME)
    assert paths.tmp_files() == [] and not paths.data.exists() and not paths.manifest.exists()
    assert_published(tmp_path, build(tmp_path, loader), rows)  # the lock was released


def test_waiters_time_out_naming_the_lock_holder(tmp_path: Path, loader) -> None:
    with shared_table_module._try_lock(TablePaths(tmp_path, NAME).lock) as locked:
        assert locked
        with pytest.raises(TimeoutError, match=rf"held by pid {os.getpid()} "):
            SharedHostTable.create_or_attach(
                NAME, NUM_ROWS, ROW_BYTES, loader, directory=tmp_path, timeout_s=0.2
            )
    assert loader.calls == 0


def test_clean_stale_tmp_files_keeps_live_writers(tmp_path: Path) -> None:
    paths = TablePaths(tmp_path, NAME)
    paths.tmp(dead_pid()).write_bytes(b"x")
    paths.tmp(os.getpid()).write_bytes(b"y")
    assert clean_stale_tmp_files(tmp_path, NAME) == [paths.tmp(dead_pid())]
    assert [path for path, _ in paths.tmp_files()] == [paths.tmp(os.getpid())]


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "t.tmp-1", "t.lock", "t.manifest.json"])
def test_names_that_collide_with_the_protocol_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValidationError, match="expected a plain file name"):
        SharedHostTable.create_or_attach(name, 1, ROW_BYTES, lambda t: None, directory=tmp_path)


def test_cuda_registration_needs_a_device(tmp_path: Path, loader) -> None:
    if torch.cuda.is_available():
        pytest.skip("registration on a GPU machine is a GPU test")
    with pytest.raises(CapacityError, match="register_cuda on table 'table': no CUDA device"):
        build(tmp_path, loader, cuda_register=True)


def test_remove_deletes_every_file(tmp_path: Path, rows, loader) -> None:
    build(tmp_path, loader)
    SharedHostTable.remove(NAME, tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- falling back to private copies -------------------------------------------------


def test_directory_too_small_falls_back_with_the_numbers(
    tmp_path: Path, rows, loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_table_module, "free_bytes", lambda path: 12_345)
    with pytest.warns(
        UserWarning,
        match=r"private copy of 66000 bytes .* has 12345 bytes .* free "
        r"but the 1 table\(s\) not there yet need 66000 bytes",
    ):
        table = build(tmp_path, loader)
    assert not table.shared and table.path is None and table.created and loader.calls == 1
    assert sha256_of(table.rows) == sha256_of(rows)
    assert mapping_permissions(TablePaths(tmp_path, NAME).data, table.rows.data_ptr()) == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_fallocate_without_space_falls_back(
    tmp_path: Path, rows, loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shared_table_module.os, "posix_fallocate", full)
    with pytest.warns(UserWarning, match=r"reserving 66000 bytes .* failed \(No space left"):
        table = build(tmp_path, loader)
    assert not table.shared and loader.calls == 1
    assert sha256_of(table.rows) == sha256_of(rows)
    assert TablePaths(tmp_path, NAME).tmp_files() == []


def request(node: str, name: str, nbytes: int, present: bool = False, free: int = 1000):
    return SharingRequest(node, "/dev/shm", name, nbytes, present, free)


def test_decide_sharing() -> None:
    one_node = [request("a/1", "t0", 400), request("a/1", "t0", 400), request("a/1", "t1", 500)]
    assert decide_sharing(one_node).shared  # t0 counted once: 900 <= 1000
    too_big = [*one_node, request("a/1", "t2", 200)]
    decision = decide_sharing(too_big)
    assert not decision.shared
    assert "1000 bytes (0.00 GiB) free but the 3 table(s) not there yet need 1100 bytes" in (
        decision.reason
    )
    present = [*one_node, request("a/1", "t2", 200, present=True)]
    assert decide_sharing(present).shared  # a table already there needs no room
    smallest_free = [*one_node[:2], request("a/1", "t1", 500, free=800)]
    assert not decide_sharing(smallest_free).shared
    two_nodes = [request("a/1", "t0", 1), request("b/2", "t0", 1), request("a/1", "t1", 1)]
    decision = decide_sharing(two_nodes)
    assert not decision.shared
    assert "on 2 nodes (a/1: ranks [0, 2]; b/2: ranks [1])" in decision.reason


def test_group_decision_goes_through_all_gather_object(
    world_of_one, tmp_path: Path, rows, loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert build(tmp_path / "ok", loader, group=world_of_one).shared
    monkeypatch.setattr(shared_table_module, "node_id", lambda: "elsewhere/0")
    calls = []
    real = dist.all_gather_object

    def two_nodes(out, obj, group=None):
        real(out, obj, group=group)
        calls.append(obj)
        out.append({**obj, "node": "other/1"})  # as if a second rank sat on another node

    monkeypatch.setattr(dist, "all_gather_object", two_nodes)
    with pytest.warns(UserWarning, match=r"on 2 nodes \(elsewhere/0: ranks \[0\]; other/1"):
        table = build(tmp_path / "split", CountingLoader(rows), group=world_of_one)
    assert calls and not table.shared


def test_group_needs_initialised_distributed(tmp_path: Path, loader) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValidationError, match="not initialised"):
        build(tmp_path, loader, group=object())


# --- a creator killed while loading -------------------------------------------------


def test_a_waiter_takes_over_from_a_killed_creator(tmp_path: Path, rows, loader) -> None:
    """A creator (another process) holds the lock and dies mid-load (SIGKILL); the process
    waiting for it sees the lock free without a complete manifest, removes the dead
    creator's tmp file and loads the table itself."""
    started = tmp_path / "started"
    creator = multiprocessing.get_context("spawn").Process(
        target=crash_worker.run,
        args=(str(tmp_path), NAME, NUM_ROWS, ROW_BYTES, str(started)),
        daemon=True,
    )
    creator.start()
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert creator.is_alive() and time.monotonic() < deadline, "the creator did not start"
            time.sleep(0.02)
        paths = TablePaths(tmp_path, NAME)
        assert [pid for _, pid in paths.tmp_files()] == [creator.pid]
        outcome: dict[str, object] = {}

        def wait_for_table() -> None:
            try:
                outcome["table"] = SharedHostTable.create_or_attach(
                    NAME,
                    NUM_ROWS,
                    ROW_BYTES,
                    loader,
                    directory=tmp_path,
                    timeout_s=30,
                    poll_s=0.01,
                )
            except BaseException as exc:  # reported below
                outcome["error"] = exc

        waiter = threading.Thread(target=wait_for_table)
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and loader.calls == 0  # waiting on the creator's lock
        assert not paths.manifest.exists()
        os.kill(creator.pid, signal.SIGKILL)  # a crash: no clean-up code runs
        creator.join(timeout=10)
        waiter.join(timeout=30)
    finally:
        if creator.is_alive():
            creator.kill()
            creator.join(timeout=10)
    assert "error" not in outcome, outcome.get("error")
    table = outcome["table"]
    assert isinstance(table, SharedHostTable) and table.created and loader.calls == 1
    assert_published(tmp_path, table, rows)  # the dead creator's tmp file is gone
