"""The consoles every subcommand prints to (stdout, and stderr for errors)."""

from __future__ import annotations

from rich.console import Console

console = Console()
err_console = Console(stderr=True)
