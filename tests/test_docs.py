"""The docs run: every ```python block and every ``engramrt ...`` command line, as written.

Each ```python block of README.md and docs/*.md runs in a fresh Python
process on the CPU (``CUDA_VISIBLE_DEVICES`` empty, ``TRITON_INTERPRET=1``)
in an empty temporary directory, and must exit 0 within its timeout. Each
line of a ```bash block that starts with ``engramrt`` runs the same way
through ``python -m engramrt.cli``, but as a user on a CPU machine types it:
without ``TRITON_INTERPRET`` (the kernels' interpreter runs in the python
blocks and the kernel tests; the CLI on a CPU takes the torch references).

A command that cannot run here says why at its end, ``# needs a GPU`` (or
``# needs <input it cannot make>``); it is skipped with that reason. A block
may opt out only through a visible ``<!-- not-run: reason -->`` comment on
the line before its fence. Both lists are printed by
:func:`test_opt_outs_are_few_and_stated`, which also bounds them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import engramrt

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(engramrt.__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

BLOCK_TIMEOUT_S = 300
NEEDS = re.compile(r"#\s*needs (\S.*?)\s*$")  # the last "# needs ..." of a line's comment
MAX_OPT_OUTS = 3  # <!-- not-run --> blocks
MAX_NEEDS_OTHER_THAN_GPU = 1  # commands skipped for a reason other than "a GPU"

KNOWN_LANGUAGES = ("python", "bash", "")  # "": plain text (diagrams, output)
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a doc."""

    doc: str  # path relative to the repository root
    language: str
    index: int  # among the doc's blocks of this language
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason given by a <!-- not-run: ... --> comment


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
    """One ``engramrt ...`` line of a bash block."""

    block: Block
    line: int  # 1-based line in the doc
    argv: tuple[str, ...]  # after "engramrt"
    comment: str

    @property
    def needs(self) -> str | None:
        """What the line says it needs and this test cannot give it (``"a GPU"``), or None."""
        match = NEEDS.search(self.comment)
        return match.group(1) if match else None


def _doc_commands() -> list[Command]:
    commands = []
    for block in _doc_blocks():
        if block.language != "bash":
            continue
        for offset, raw in enumerate(block.code.splitlines()):
            command, comment = split_comment(raw.strip())
            words = shlex.split(command)
            if words and words[0] == "engramrt":
                commands.append(Command(block, block.line + 1 + offset, tuple(words[1:]), comment))
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
        marks: list[pytest.MarkDecorator] = []
        if command.needs is not None:
            reason = f"{command.block.doc}:{command.line}: needs {command.needs}"
            marks.append(pytest.mark.skip(reason=reason))
        elif command.block.not_run is not None:
            marks.append(pytest.mark.skip(reason=f"not-run: {command.block.not_run}"))
        name = f"{command.block.doc}:{command.line}:engramrt {' '.join(command.argv[:2])}"
        params.append(pytest.param(command, id=name, marks=marks))
    return params


@pytest.mark.parametrize("block", _python_params())
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    run_python_block(block.code, tmp_path, f"{block.doc}:{block.line} (python block {block.index})")


@pytest.mark.parametrize("command", _command_params())
def test_cli_line_runs(command: Command, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "engramrt.cli", *command.argv]
    run_in_fresh_process(
        argv,
        tmp_path,
        f"{command.block.doc}:{command.line} engramrt {shlex.join(command.argv)}",
        interpret=False,
    )


def test_docs_have_blocks_to_run() -> None:
    """The extraction finds the blocks (a parser that finds none would pass everything)."""
    blocks = _doc_blocks()
    per_doc = {path.relative_to(ROOT).as_posix(): 0 for path in DOC_FILES}
    for block in blocks:
        if block.language == "python":
            per_doc[block.doc] += 1
    assert per_doc["README.md"] >= 3, per_doc
    commands = [c for c in _doc_commands() if c.block.doc == "README.md"]
    assert len(commands) >= 8, [" ".join(c.argv) for c in commands]


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
            print(
                f"\nnot run: {command.block.doc}:{command.line} engramrt "
                f"{shlex.join(command.argv)}: needs {command.needs}"
            )
    assert len(opted_out) <= MAX_OPT_OUTS, [f"{b.doc}:{b.line}" for b in opted_out]
    other = [f"{c.block.doc}:{c.line}" for c in skipped if c.needs != "a GPU"]
    assert len(other) <= MAX_NEEDS_OTHER_THAN_GPU, other
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
