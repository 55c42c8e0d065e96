"""What one ``engramrt hash`` run hashes and where its ids go, for every family's runner."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramrt.errors import ValidationError

__all__ = ["HashRun", "load_ids_file", "print_match", "save_row_ids"]


@dataclass(frozen=True)
class HashRun:
    """The options of one ``engramrt hash`` run, passed whole to its family's runner.

    Attributes:
        config: ``--config`` as given. text, ids, ids_file: the token source (exactly one
            is set). tokenizer: ``--tokenizer`` (None: the family's default, if any).
        chunk_sizes: ``--chunks`` parsed (None: one chunk). history: ``--history`` (None:
            not given). backend: ``--backend``. device: ``--device`` as a ``torch.device``.
        out: ``--out`` (None: not saved). as_json: ``--json``.
    """

    config: str
    text: str | None
    ids: str | None
    ids_file: Path | None
    tokenizer: Path | None
    chunk_sizes: list[int] | None
    history: str | None
    backend: str
    device: Any
    out: Path | None
    as_json: bool

    @property
    def ids_option(self) -> str:
        """The option the token ids come from (``"--text"``, ``"--ids"``, ``"--ids-file"``)."""
        return (
            "--text" if self.text is not None else "--ids" if self.ids is not None else "--ids-file"
        )

    def token_ids(self) -> Any:
        """``[T]`` int64 numpy token ids from the one source given (``--text`` through
        :attr:`tokenizer`); refuses no token."""
        import numpy as np

        from engramrt.cli._checks import parse_int_list
        from engramrt.tokenmap import load_tokenizer

        if self.text is not None:
            encoded = load_tokenizer(self.tokenizer).encode(self.text, add_special_tokens=False)
            token_ids = np.array(encoded.ids, np.int64)
        elif self.ids is not None:
            token_ids = np.array(parse_int_list("--ids", self.ids), dtype=np.int64)
        else:
            assert self.ids_file is not None
            token_ids = load_ids_file(self.ids_file)
        if token_ids.size == 0:
            raise ValidationError(
                f"{self.ids_option} gives no token; expected at least one token id"
            )
        return token_ids


def load_ids_file(path: Path) -> Any:
    """The 1-D integer token ids of a ``.npy`` file (no pickles, no casting of floats or bools)."""
    import numpy as np

    from engramrt.cli._checks import os_error

    try:
        array = np.load(path, allow_pickle=False)
    except OSError as exc:
        raise os_error(f"--ids-file={str(path)!r} cannot be read", exc) from exc
    except ValueError as exc:
        raise ValidationError(f"--ids-file={str(path)!r} is not a readable .npy: {exc}") from exc
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu":
        found = getattr(array, "dtype", type(array).__name__)
        raise ValidationError(
            f"--ids-file={str(path)!r} holds {found}; expected integer token ids "
            f"(int32/int64/uint32 ...), not floats, bools or strings"
        )
    if array.ndim != 1:
        raise ValidationError(
            f"--ids-file={str(path)!r} has shape {list(array.shape)}; expected one sequence, "
            f"a 1-D array [T]"
        )
    if array.dtype.kind == "u" and array.size and int(array.max()) > 2**63 - 1:
        raise ValidationError(
            f"--ids-file={str(path)!r} holds {int(array.max())}, which does not fit int64"
        )
    return array.astype(np.int64)


def save_row_ids(out: Path, row_ids: Any) -> None:
    """Write ``row_ids`` (``[T, L, C]`` int64) to ``out`` as ``.npy``, atomically."""
    import numpy as np

    from engramrt.cli._checks import write_output

    buf = io.BytesIO()
    np.save(buf, row_ids)
    write_output("--out", out, buf.getvalue())


def print_match(run: HashRun, summary: str, row_ids: Any, matches: bool) -> None:
    """Print ``summary`` (what was hashed, how), whether streaming matched one-shot hashing
    and, with ``--out``, where the ``[T, L, C]`` row ids went: the last lines of every
    family's table output."""
    from engramrt.cli._console import console

    console.print(
        f"{summary}: "
        + (
            "[green]matches one-shot hashing[/]"
            if matches
            else "[red]DIFFERS from one-shot hashing[/]"
        )
    )
    if run.out is not None:
        console.print(f"saved {list(row_ids.shape)} int64 to {run.out}")
