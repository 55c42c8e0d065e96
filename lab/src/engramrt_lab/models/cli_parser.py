"""The argument parser of the tiny model's commands (training, seeds, pairs, heads), and
how the reporting ones hand their result out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engramrt._io import atomic_write_bytes

__all__ = ["OneLineParser", "report"]


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit status 2 (no usage block)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def report(result: Any, json_path: Path | None, table: str) -> int:
    """Write ``result`` as JSON to ``json_path`` (atomically; None: nowhere), print
    ``table``, and return the exit status 0."""
    if json_path is not None:
        atomic_write_bytes(json_path, (json.dumps(result, indent=1) + "\n").encode())
    sys.stdout.write(table)
    return 0
