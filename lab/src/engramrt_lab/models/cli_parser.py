"""The argument parser of the tiny model's commands (training, seeds, pairs)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit status 2 (no usage block)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)
