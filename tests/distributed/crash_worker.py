"""A creator that crashes mid-load, for tests/distributed/test_shared_table.py.

Started with ``spawn``; takes the creation lock of table ``name``, writes
half of the rows, signals ``started_file`` and sleeps until the test kills
it (SIGKILL: no clean-up code runs, as in a real crash).
"""

from __future__ import annotations

import time
from pathlib import Path


def run(directory: str, name: str, num_rows: int, row_bytes: int, started_file: str) -> None:
    import torch

    from engramrt.distributed import SharedHostTable

    def load(target: torch.Tensor) -> None:
        half = num_rows // 2
        target[:half] = torch.randint(0, 256, (half, row_bytes), dtype=torch.uint8)
        Path(started_file).write_text("loading")
        time.sleep(120)

    SharedHostTable.create_or_attach(
        name, num_rows, row_bytes, load, directory=directory, timeout_s=60
    )
