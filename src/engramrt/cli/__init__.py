"""The ``engramrt`` command line.

Each subcommand lives in its own module and imports what it needs (torch,
kernels) only when it runs, so ``engramrt --help`` is instant. Other
distributions add commands through the entry point group
:data:`COMMANDS_GROUP`: each entry point names a function that takes the
typer app and registers its commands on it (the lab, ``engramrt-lab``, adds
``engramrt demo`` this way).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

from engramrt.cli._console import console as console
from engramrt.cli._console import err_console
from engramrt.errors import EngramError

COMMANDS_GROUP = "engramrt.commands"
"""The entry point group whose functions ``register(app)`` add commands to ``engramrt``."""

HELP = "The Engram runtime: exact n-gram hashing, fp8 table lookups and a fused gate."
WITHOUT_LAB = (
    "\n\n`engramrt demo` (a trained tiny Engram LM served through the runtime) comes with the "
    "lab: `pip install -e lab` in a checkout of engramrt, or `pip install engramrt-lab`."
)
"""Added to the help when no installed distribution registers commands."""

app = typer.Typer(
    name="engramrt",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """The Engram runtime: exact n-gram hashing, fp8 table lookups and a fused gate."""


def _register() -> None:
    from engramrt.cli import inspect_cmd

    inspect_cmd.register(app)
    for name in ("hash_cmd", "plan_cmd", "convert_cmd", "bench_cmd"):
        try:
            module = __import__(f"engramrt.cli.{name}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != f"engramrt.cli.{name}":
                raise
            continue
        module.register(app)
    plugins = command_plugins()
    for register in plugins:
        register(app)
    if not plugins:
        app.info.help = HELP + WITHOUT_LAB


def command_plugins() -> list[Callable[[typer.Typer], None]]:
    """The ``register(app)`` functions of every installed entry point in
    :data:`COMMANDS_GROUP`, sorted by entry point name (none: the product's commands only)."""
    from importlib.metadata import entry_points

    points = sorted(entry_points(group=COMMANDS_GROUP), key=lambda point: point.name)
    return [point.load() for point in points]


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point: bad input is a one-line error on stderr and exit code 2."""
    try:
        app(args=argv, prog_name="engramrt")
    except EngramError as exc:
        _fail(str(exc))
    except OSError as exc:
        # A file the user named that the checks above did not foresee (a
        # permission, a vanished directory): still one line, never a traceback.
        from engramrt.cli._checks import os_error

        _fail(str(os_error("a file operation failed", exc)))


def _fail(message: str) -> None:
    from rich.markup import escape

    # Escaped: messages quote shapes such as [T] that rich would read as markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
