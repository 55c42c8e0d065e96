"""The lab's commands for the ``engramrt`` command line.

:func:`register` is the lab's entry point in the group ``engramrt.commands``: the
product's CLI calls it with its typer app, and ``engramrt demo`` appears.
"""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add ``engramrt demo`` to ``app``."""
    from engramrt_lab.cli import demo_cmd

    demo_cmd.register(app)
