"""What a long command is doing, while it does it.

:class:`Stages` says each stage's name as it starts (a spinner with the
elapsed time on a terminal, from rich) and prints one line with the seconds it
took when it ends, so that no stage of more than a second passes in silence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.markup import escape

__all__ = ["Stages"]


class Stages:
    """Announces stages on ``console`` (stderr for commands whose stdout is JSON)."""

    def __init__(self, console: Any) -> None:
        self.console = console

    def say(self, text: str) -> None:
        """One line, printed at once (rich markup allowed)."""
        self.console.print(text, highlight=False, soft_wrap=True)

    @contextmanager
    def stage(self, what: str) -> Iterator[None]:
        """Run the body as the stage ``what``; a spinner while it runs, its time after."""
        began = time.perf_counter()
        if self.console.is_terminal:
            with self.console.status(escape(what) + " …"):
                yield
        else:
            yield
        seconds = time.perf_counter() - began
        self.console.print(
            f"[dim]  {escape(what)}: {seconds:.1f} s[/]", highlight=False, soft_wrap=True
        )
