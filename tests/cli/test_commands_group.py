"""Commands from other distributions: the entry point group ``engramrt.commands``.

With the lab installed, its entry point adds ``engramrt demo``; without it (here: a
process whose entry point lookup finds nothing in the group, as a fresh install of the
product alone does), ``demo`` is no command and ``engramrt --help`` says how to get it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import engramrt
from engramrt.cli import COMMANDS_GROUP, app, command_plugins

SRC = Path(engramrt.__file__).resolve().parents[1]

WITHOUT_ENTRY_POINTS = f"""
import importlib.metadata as metadata

found = metadata.entry_points


def entry_points(**selection):
    if selection.get("group") == {COMMANDS_GROUP!r}:
        return metadata.EntryPoints(())
    return found(**selection)


metadata.entry_points = entry_points
import sys

from engramrt.cli import main

main(sys.argv[1:])
"""


def _cli_without_the_lab(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_ENTRY_POINTS, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _command_names() -> set[str]:
    return {command.name or command.callback.__name__ for command in app.registered_commands}


def test_the_lab_adds_demo_through_its_entry_point() -> None:
    from engramrt_lab.cli import register

    assert register in command_plugins()
    assert "demo" in _command_names()


def test_without_the_lab_demo_is_no_command_and_help_says_how_to_get_it() -> None:
    helped = _cli_without_the_lab("--help")
    assert helped.returncode == 0, helped.stderr
    assert "pip install engramrt-lab" in helped.stdout, helped.stdout
    assert "demo" not in helped.stdout.split("Commands")[-1], helped.stdout
    refused = _cli_without_the_lab("demo")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "No such command 'demo'" in refused.stderr, refused.stderr
    # Control: the same process with the lab's entry point found serves demo's help.
    env = {**os.environ, "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    with_lab = subprocess.run(
        [sys.executable, "-m", "engramrt.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert with_lab.returncode == 0, with_lab.stderr
    assert "--max-new-tokens" in with_lab.stdout, with_lab.stdout
