"""Checks of command-line values, so that bad input is one line naming the option, not a traceback.

Every function raises an :class:`~engramrt.errors.EngramError` subclass
whose message names the option, the value given and what was expected;
:func:`engramrt.cli.main` prints it and exits with code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engramrt.errors import ValidationError, os_error

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "check_output_path",
    "check_tp",
    "os_error",
    "parse_device",
    "parse_float",
    "parse_int",
    "parse_int_list",
    "parse_optional_int",
    "read_text",
    "write_output",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def parse_int(option: str, text: str) -> int:
    """One integer option given as text, so a bad value is one line naming it (not a usage box)."""
    try:
        return int(text.strip())
    except ValueError as exc:
        raise ValidationError(f"{option}={text!r}; expected an integer") from exc


def parse_optional_int(option: str, text: str | None) -> int | None:
    """:func:`parse_int` for an option that may be left out (None)."""
    return None if text is None else parse_int(option, text)


def parse_float(option: str, text: str) -> float:
    """One number given as text, so a bad value is one line naming it (not a usage box); the
    caller checks its range (finite, positive, ...)."""
    try:
        return float(text.strip())
    except ValueError as exc:
        raise ValidationError(f"{option}={text!r}; expected a number") from exc


def parse_int_list(option: str, text: str, *, allow_empty: bool = False) -> list[int]:
    """Comma-separated integers that fit int64 (``"1, 2,3"``)."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise ValidationError(f"{option}={text!r} must be comma-separated integers") from exc
    for index, value in enumerate(values):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValidationError(
                f"{option}={text!r}: value {index} ({value}) does not fit int64; expected "
                f"integers in [{INT64_MIN}, {INT64_MAX}]"
            )
    if not values and not allow_empty:
        raise ValidationError(f"{option}={text!r} holds no integer; expected at least one")
    return values


def parse_device(option: str, value: str, *, allow_auto: bool = False) -> Any:
    """A ``torch.device`` for ``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine
    (:func:`engramrt._device.check_device`)."""
    from engramrt._device import check_device

    return check_device(option, value, allow_auto=allow_auto)


def check_tp(option: str, tp: int, n_cols: int) -> int:
    """A tensor-parallel size that gives every rank a hash column (short message for huge ones)."""
    from engramrt.errors import ShardingError

    if tp < 1:
        raise ShardingError(f"{option}={tp}; expected a tensor-parallel size >= 1")
    if tp > n_cols:
        raise ShardingError(
            f"{option}={tp}; expected at most C={n_cols} (the config's hash columns: every rank "
            f"needs one)"
        )
    return tp


def check_output_path(option: str, path: Path) -> Path:
    """Refuse an output path that names a directory or lies under a regular file."""
    if path.is_dir():
        raise ValidationError(f"{option}={str(path)!r} is a directory; expected a file path")
    parent = path.absolute().parent
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValidationError(
            f"{option}={str(path)!r} lies under {str(probe)!r}, which is a file; expected a "
            f"path in a directory"
        )
    return path


def write_output(option: str, path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; errors name ``option`` and the path."""
    from engramrt._io import atomic_write_bytes

    check_output_path(option, path)
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise os_error(f"{option}={str(path)!r} cannot be written", exc) from exc


def read_text(option: str, path: Path) -> str:
    """The UTF-8 text of ``path``; errors name ``option`` and the path."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(
            f"{option}={str(path)!r} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from exc
    except OSError as exc:
        raise os_error(f"{option}={str(path)!r} cannot be read", exc) from exc
