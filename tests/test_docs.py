"""The docs run: every ```python block and every command line, as written.

Each ```python block of README.md, BENCHMARKS.md and docs/*.md runs in a
fresh Python process on the CPU (``CUDA_VISIBLE_DEVICES`` empty,
``TRITON_INTERPRET=1``) in an empty temporary directory, and must exit 0
within its timeout. Every other line of a ```bash block is a command a user
is shown. One that starts with ``engramrt`` runs the same way through
``python -m engramrt.cli``, but as a user on a CPU machine types it: without
``TRITON_INTERPRET`` (the kernels' interpreter runs in the python blocks and
the kernel tests; the CLI on a CPU takes the torch references). One that
starts with ``python`` runs with this interpreter in a scratch copy of the
checkout's ``bench/``, ``docs/``, ``examples/`` and top-level docs, the way a
user runs it from the checkout (so a script that writes beside itself writes
into the copy).

A command that cannot run here says why at its end, ``# needs a GPU``,
``# needs network ...`` (or ``# needs <what it takes that this test cannot
give>``); it is skipped with that reason, and every command that starts with
anything else (``pip``, ``scripts/...``, ``torchrun``) must say it. A block
may opt out only through a visible ``<!-- not-run: reason -->`` comment on
the line before its fence. Both lists are printed by
:func:`test_opt_outs_are_few_and_stated`, which also bounds them.

A ```bash block whose fence follows ``<!-- run-after: previous python block -->``
works on what the doc's python block before it wrote: its commands run in
that block's directory after it, in order (each line after the lines above it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import engramrt

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(engramrt.__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKOUT_COPY = ("bench", "docs", "examples", "README.md", "BENCHMARKS.md")
"""What a ``python ...`` command line finds around it: a copy of these, as in the checkout."""

BLOCK_TIMEOUT_S = 300
NEEDS = re.compile(r"#\s*needs (\S.*?)\s*$")  # the last "# needs ..." of a line's comment
MAX_OPT_OUTS = 3  # <!-- not-run --> blocks
MAX_NEEDS_OTHER = 3  # commands skipped for a reason other than GPUs or the network
RUNNERS = ("engramrt", "python")  # what a command this test runs starts with
GPU_OR_NETWORK = re.compile(r"^((a|\d+) GPUs?|network)\b")

KNOWN_LANGUAGES = ("python", "bash", "")  # "": plain text (diagrams, output)
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")
_RUN_AFTER = "<!-- run-after: previous python block -->"


@dataclass(frozen=True)
class Block:
    """One fenced block of a doc."""

    doc: str  # path relative to the repository root
    language: str
    index: int  # among the doc's blocks of this language
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason given by a <!-- not-run: ... --> comment
    run_after: bool = False  # <!-- run-after: previous python block -->


def extract_blocks(doc: str, text: str) -> list[Block]:
    """Fenced blocks of ``text`` in order.

    An unterminated fence, or one indented or carrying more than a language
    after its backticks, is an error rather than a block nobody runs.
    """
    blocks: list[Block] = []
    counts: dict[str, int] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            if lines[i].lstrip().startswith("```"):
                raise AssertionError(f"{doc}:{i + 1}: a fence this test cannot read: {lines[i]!r}")
            i += 1
            continue
        language, start = match.group(1), i
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{doc}:{start + 1}: fence never closed")
        previous = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        opt_out = _NOT_RUN.match(previous)
        index = counts.get(language, 0)
        counts[language] = index + 1
        blocks.append(
            Block(
                doc=doc,
                language=language,
                index=index,
                line=start + 1,
                code="\n".join(lines[start + 1 : end]) + "\n",
                not_run=opt_out.group(1) if opt_out else None,
                run_after=previous == _RUN_AFTER,
            )
        )
        i = end + 1
    return blocks


def _doc_blocks() -> list[Block]:
    return [
        block
        for path in DOC_FILES
        for block in extract_blocks(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    ]


def split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)`` of one shell line: the comment starts at a ``#`` outside quotes."""
    quote = ""
    for pos, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (pos == 0 or line[pos - 1].isspace()):
            return line[:pos].rstrip(), line[pos:].strip()
    return line.rstrip(), ""


@dataclass(frozen=True)
class Command:
    """One command line of a bash block (every line but blanks and comments)."""

    block: Block
    line: int  # 1-based line in the doc
    words: tuple[str, ...]  # the program, then its arguments
    comment: str
    setup: Block | None = None  # the python block a run-after block's commands follow
    before: tuple[Command, ...] = ()  # the lines above it in a run-after block

    @property
    def program(self) -> str:
        return self.words[0]

    @property
    def argv(self) -> tuple[str, ...]:
        """The arguments, after the program."""
        return self.words[1:]

    @property
    def needs(self) -> str | None:
        """What the line says it needs and this test cannot give it (``"a GPU"``), or None."""
        match = NEEDS.search(self.comment)
        return match.group(1) if match else None

    def argv_here(self) -> list[str]:
        """The command as this test runs it: ``engramrt`` through ``python -m engramrt.cli``,
        ``python`` as this interpreter."""
        if self.program == "engramrt":
            return [sys.executable, "-m", "engramrt.cli", *self.argv]
        assert self.program == "python", self.words
        return [sys.executable, *self.argv]

    @property
    def where(self) -> str:
        return f"{self.block.doc}:{self.line} {shlex.join(self.words)}"


def _doc_commands() -> list[Command]:
    commands: list[Command] = []
    blocks = _doc_blocks()
    for position, block in enumerate(blocks):
        if block.language != "bash":
            continue
        setup = None
        if block.run_after:
            setup = next((b for b in reversed(blocks[:position]) if b.language == "python"), None)
            assert setup is not None and setup.doc == block.doc, (
                f"{block.doc}:{block.line}: run-after with no python block before it"
            )
        before: list[Command] = []
        for offset, raw in enumerate(block.code.splitlines()):
            command, comment = split_comment(raw.strip())
            words = shlex.split(command)
            if not words:
                continue
            line = Command(
                block, block.line + 1 + offset, tuple(words), comment, setup, tuple(before)
            )
            commands.append(line)
            if setup is not None:
                before.append(line)
    return commands


def _environment(interpret: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH", "")])]
    )
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_in_fresh_process(argv: list[str], cwd: Path, what: str, *, interpret: bool = True) -> None:
    """Run ``argv`` in ``cwd`` on the CPU; fail with its output unless it exits 0 in time."""
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=_environment(interpret),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{what} ran past {BLOCK_TIMEOUT_S} s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"{what} exited {proc.returncode}\n"
            f"stdout (last 3000 chars):\n{proc.stdout[-3000:]}\n"
            f"stderr (last 6000 chars):\n{proc.stderr[-6000:]}"
        )


def run_python_block(code: str, cwd: Path, what: str) -> None:
    script = cwd / "doc_block.py"
    script.write_text(code, encoding="utf-8")
    run_in_fresh_process([sys.executable, str(script)], cwd, what)


def _python_params() -> list[object]:
    params: list[object] = []
    for block in _doc_blocks():
        if block.language != "python":
            continue
        marks: list[pytest.MarkDecorator] = []
        if block.not_run is not None:
            marks.append(pytest.mark.skip(reason=f"not-run: {block.not_run}"))
        params.append(pytest.param(block, id=f"{block.doc}:python{block.index}", marks=marks))
    return params


def _command_params() -> list[object]:
    params: list[object] = []
    for command in _doc_commands():
        if command.program not in RUNNERS:
            continue  # it must say what it needs: test_every_command_runs_or_says_what_it_needs
        marks: list[pytest.MarkDecorator] = []
        if command.needs is not None:
            reason = f"{command.block.doc}:{command.line}: needs {command.needs}"
            marks.append(pytest.mark.skip(reason=reason))
        elif command.block.not_run is not None:
            marks.append(pytest.mark.skip(reason=f"not-run: {command.block.not_run}"))
        name = f"{command.block.doc}:{command.line}:{' '.join(command.words[:3])}"
        params.append(pytest.param(command, id=name, marks=marks))
    return params


def copy_checkout(into: Path) -> None:
    """The parts of the checkout a ``python ...`` line reads or writes, copied into ``into``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CHECKOUT_COPY:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=ignore)
        else:
            shutil.copy2(source, into / name)


@pytest.mark.parametrize("block", _python_params())
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    run_python_block(block.code, tmp_path, f"{block.doc}:{block.line} (python block {block.index})")


@pytest.mark.parametrize("command", _command_params())
def test_command_line_runs(command: Command, tmp_path: Path) -> None:
    if command.program == "python":
        copy_checkout(tmp_path)
    if command.setup is not None:
        run_python_block(
            command.setup.code, tmp_path, f"{command.setup.doc}:{command.setup.line} (set-up)"
        )
    for earlier in command.before:
        run_in_fresh_process(earlier.argv_here(), tmp_path, earlier.where, interpret=False)
    run_in_fresh_process(command.argv_here(), tmp_path, command.where, interpret=False)


def test_every_command_runs_or_says_what_it_needs() -> None:
    """A line this test cannot run (``pip``, ``scripts/...``, ``torchrun``) says what it
    needs; a ``# needs`` on a line it could run names something real, not a convenience."""
    silent = silent_commands(_doc_commands())
    assert not silent, f"say what these need (# needs a GPU, # needs network ...): {silent}"


def silent_commands(commands: list[Command]) -> list[str]:
    """Commands this test cannot run that do not say what they need."""
    return [c.where for c in commands if c.program not in RUNNERS and c.needs is None]


def test_docs_have_blocks_to_run() -> None:
    """The extraction finds the blocks (a parser that finds none would pass everything)."""
    blocks = _doc_blocks()
    per_doc = {path.relative_to(ROOT).as_posix(): 0 for path in DOC_FILES}
    for block in blocks:
        if block.language == "python":
            per_doc[block.doc] += 1
    assert per_doc["README.md"] >= 3, per_doc
    commands = [c for c in _doc_commands() if c.block.doc == "README.md"]
    assert len([c for c in commands if c.program == "engramrt"]) >= 8, [c.where for c in commands]
    assert {c.program for c in _doc_commands()} >= {"engramrt", "python", "pip"}


def test_every_fence_is_run_or_plain_text() -> None:
    """A ```py or ```sh block would not be run by the tests above: refuse the label."""
    unknown = [
        f"{b.doc}:{b.line} ```{b.language}"
        for b in _doc_blocks()
        if b.language not in KNOWN_LANGUAGES
    ]
    assert not unknown, f"label these python or bash (or leave them unlabelled as text): {unknown}"


def test_readme_opens_with_its_two_commands() -> None:
    first = _doc_blocks()[0]
    assert first.doc == "README.md" and first.language == "bash", first
    assert first.line <= 3, f"README.md's first block opens at line {first.line}"
    lines = [split_comment(line)[0] for line in first.code.splitlines() if line.strip()]
    assert [line.split()[0] for line in lines] == ["scripts/setup", "scripts/test"], lines


def test_opt_outs_are_few_and_stated(capsys: pytest.CaptureFixture[str]) -> None:
    opted_out = [b for b in _doc_blocks() if b.not_run is not None]
    skipped = [c for c in _doc_commands() if c.needs is not None]
    with capsys.disabled():
        for block in opted_out:
            print(f"\nnot run: {block.doc}:{block.line} {block.language} block: {block.not_run}")
        for command in skipped:
            print(f"\nnot run: {command.where}: needs {command.needs}")
    assert len(opted_out) <= MAX_OPT_OUTS, [f"{b.doc}:{b.line}" for b in opted_out]
    other = [c.where for c in skipped if not GPU_OR_NETWORK.match(c.needs or "")]
    assert len(other) <= MAX_NEEDS_OTHER, other
    for block in opted_out:
        assert len(block.not_run or "") >= 10, f"{block.doc}:{block.line}: give a real reason"


def test_extraction_and_runner_on_a_sample(tmp_path: Path) -> None:
    """Controls: the parser sees fences, opt-outs and comments; a broken block fails."""
    sample = (
        "text\n\n```python\nprint('ok')\n```\n\n<!-- not-run: needs a real checkpoint -->\n"
        "```python\nprint(undefined_name)\n```\n\n```bash\n"
        'engramrt hash --text "a # b" --chunks 1  # needs a GPU\n```\n'
    )
    blocks = extract_blocks("sample.md", sample)
    assert [(b.language, b.index, b.line, b.not_run) for b in blocks] == [
        ("python", 0, 3, None),
        ("python", 1, 8, "needs a real checkpoint"),
        ("bash", 0, 12, None),
    ]
    line = blocks[2].code.strip()
    assert split_comment(line) == ('engramrt hash --text "a # b" --chunks 1', "# needs a GPU")
    block = blocks[2]
    assert Command(block, 13, ("hash",), split_comment(line)[1]).needs == "a GPU"
    assert Command(block, 13, ("hash",), "# 3 tokens").needs is None
    for unreadable in ("  ```python\nx = 1\n  ```\n", "```python\nx = 1\n", "```py title\n```\n"):
        with pytest.raises(AssertionError, match=r"sample\.md:1"):
            extract_blocks("sample.md", unreadable)
    run_python_block(blocks[0].code, tmp_path, "sample block 0")
    with pytest.raises(pytest.fail.Exception, match="NameError: name 'undefined_name'"):
        run_python_block(blocks[1].code, tmp_path, "sample block 1")


def test_commands_of_a_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Controls: every line of a bash block is a command; one this test cannot run and that
    says nothing is caught; a run-after block follows its python block, line after line."""
    sample = (
        "```python\nopen('made.txt', 'w').write('x')\n```\n\n"
        "<!-- run-after: previous python block -->\n```bash\n"
        "python -c \"import os; assert os.path.exists('made.txt'); open('b', 'w')\"\n"
        "# a comment line\n"
        "python -c \"import os; assert os.path.exists('b')\"\n```\n\n"
        "```bash\npip install engramrt\nscripts/setup  # needs network: pip\n```\n"
    )
    doc = tmp_path / "sample.md"
    doc.write_text(sample)
    monkeypatch.setattr(sys.modules[__name__], "DOC_FILES", [doc])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    commands = _doc_commands()
    assert [(c.line, c.program, c.setup is not None, len(c.before)) for c in commands] == [
        (7, "python", True, 0),
        (9, "python", True, 1),
        (13, "pip", False, 0),
        (14, "scripts/setup", False, 0),
    ]
    assert silent_commands(commands) == ["sample.md:13 pip install engramrt"]
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "CHECKOUT_COPY", ())
    test_command_line_runs(commands[1], tmp_path / "run")  # the block, then the line above it
    (tmp_path / "alone").mkdir()
    with pytest.raises(pytest.fail.Exception, match="AssertionError"):
        run_in_fresh_process(commands[1].argv_here(), tmp_path / "alone", "without its set-up")
