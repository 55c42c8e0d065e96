"""Run worker processes of one torch.distributed world, bounded in time, for the tests."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def spawn_world(
    target: Callable[..., None],
    world: int,
    out_dir: Path,
    *extra_args: Any,
    deadline_s: float,
    label: str,
) -> None:
    """Start ``target(rank, world, init_file, out_dir, *extra_args)`` per rank and wait.

    Workers write ``error-<rank>.txt`` on failure. Processes still running at
    ``deadline_s`` (start-up included) are killed; hung, failed or erroring
    workers fail the test with their tracebacks.
    """
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=target,
            args=(rank, world, str(out_dir / "init"), str(out_dir), *extra_args),
            daemon=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join(timeout=10)
    errors = {path.name: path.read_text() for path in sorted(out_dir.glob("error-*.txt"))}
    if hung or errors or any(process.exitcode != 0 for process in processes):
        codes = [process.exitcode for process in processes]
        details = "\n".join(f"--- {name}\n{text}" for name, text in errors.items())
        pytest.fail(f"{label} workers hung: {hung}, exit codes: {codes}\n{details}")


def torchrun_bench(
    script: str, *options: str, nproc: int = 2, timeout_s: float = 240
) -> subprocess.CompletedProcess:
    """``bench/<script>`` under ``torch.distributed.run --standalone`` with ``nproc`` CPU
    processes, this checkout's sources first on the path and Triton's interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port: other test processes may be running torchrun too
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "bench" / script),
        *options,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
