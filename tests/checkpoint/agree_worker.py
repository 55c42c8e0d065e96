"""One rank of the 2-process world (gloo, or NCCL on two GPUs) of tests/checkpoint/test_rank_agreement.py.

The test process converts source A into ``dst`` and writes source B beside it;
each scenario runs here once, in order, and each rank saves what it saw to
``out_dir/rank<r>.pt`` (errors as their messages). A failure of the worker
itself is written to ``error-<rank>.txt``.

Scenarios (every rank takes part in each, in the same order):

- ``same``: both ranks load ``dst`` with ``group=``: the rows of A, and the
  conversion id of A;
- ``passed-open``: rank 0 opens ``dst`` (A), then converts B into it; rank 1
  opens it afterwards (B); both pass their open checkpoint with ``group=``:
  refused on both, naming both ids;
- ``reopened``: ``dst`` holds B; rank 0's first open is followed by a
  conversion of A into ``dst`` before rank 1 opens: the ranks differ on the
  first attempt, open the path again and both load A;
- ``missing``: rank 1 is given a path that does not exist: its own error,
  and on rank 0 one naming rank 1.
"""

from __future__ import annotations

import datetime
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

TIMEOUT_S = 60.0


def _wait_for(flag: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{flag} never appeared")
        time.sleep(0.01)


def run(
    rank: int, world_size: int, init_file: str, out_dir_name: str, work: str, backend: str
) -> None:
    out_dir = Path(out_dir_name)
    try:
        import torch
        import torch.distributed as dist

        from engramrt.checkpoint import (
            SafetensorsCheckpoint,
            convert_checkpoint,
            load_tables,
        )
        from engramrt.checkpoint import ranks as ranks_module
        from engramrt.config import load_config
        from engramrt.errors import CheckpointError
        from engramrt.lookup.tiers import TablePlacement

        warnings.simplefilter("ignore")  # the test tables record no token map
        if backend == "nccl":  # the ids travel through the GPU: one device per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        root = Path(work)
        config = load_config(root / "config.json")
        dst, src_a, src_b = root / "dst", root / "a.safetensors", root / "b.safetensors"
        placement = TablePlacement("host", "cpu", tp=world_size, rank=rank)
        saved: dict[str, Any] = {}

        def attempt(key: str, call: Any) -> None:
            try:
                stores = call()
                saved[key] = [s.gather_packed(torch.arange(s.num_rows)) for s in stores]
            except CheckpointError as exc:
                saved[key] = f"CheckpointError: {exc}"

        # -- same: one conversion on both ranks --
        loaded: dict[str, Any] = {}

        def same() -> Any:
            with SafetensorsCheckpoint(dst) as held:
                stores = load_tables(held, config, placement, group=dist.group.WORLD)
                loaded["id"] = held.conversion_id
            return stores

        attempt("same", same)
        saved["same_id"] = loaded.get("id")
        dist.barrier()

        # -- passed-open: rank 0 holds A, B commits, rank 1 holds B --
        if rank == 0:
            held = SafetensorsCheckpoint(dst)
            saved["passed_open_id"] = held.conversion_id
            convert_checkpoint(src_b, dst, config, tp=world_size)
        dist.barrier()
        if rank == 1:
            held = SafetensorsCheckpoint(dst)
            saved["passed_open_id"] = held.conversion_id
        attempt("passed-open", lambda: load_tables(held, config, placement, group=dist.group.WORLD))
        held.close()
        dist.barrier()

        # -- reopened: rank 0's first open sees B, then A commits before rank 1 opens --
        flag = root / "a-committed"
        opens = []
        original = ranks_module.SafetensorsCheckpoint

        class Racing(original):  # type: ignore[misc, valid-type]
            def __init__(self, path: Any) -> None:
                if rank == 1 and not opens:
                    _wait_for(flag)
                super().__init__(path)
                opens.append(self.conversion_id)
                if rank == 0 and len(opens) == 1:
                    convert_checkpoint(src_a, dst, config, tp=world_size)
                    flag.touch()

        ranks_module.SafetensorsCheckpoint = Racing  # type: ignore[misc]
        try:
            attempt("reopened", lambda: load_tables(dst, config, placement, group=dist.group.WORLD))
        finally:
            ranks_module.SafetensorsCheckpoint = original  # type: ignore[misc]
        saved["reopened_opens"] = opens
        dist.barrier()

        # -- missing: rank 1 cannot open its path --
        path = dst if rank == 0 else root / "nonexistent"
        attempt("missing", lambda: load_tables(path, config, placement, group=dist.group.WORLD))

        torch.save(saved, out_dir / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
