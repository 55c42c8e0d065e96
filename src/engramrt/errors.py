"""Exception types raised by engramrt.

Every error names the parameter, the value that was found and what was
expected, so a caller can fix the input without reading our source. All of
them derive from :class:`EngramError` (itself a ``ValueError``), so callers
can catch everything engramrt raises about bad input in one place.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ConfigError",
    "EngramError",
    "LayoutError",
    "LockTimeoutError",
    "ShardingError",
    "TokenizerError",
    "UntrustedFileError",
    "ValidationError",
    "os_error",
]


class EngramError(ValueError):
    """Base class of every error engramrt raises about its input."""


class ConfigError(EngramError):
    """An Engram config is missing, unreadable, malformed or out of range."""


class LayoutError(EngramError):
    """A config cannot hold the hash layout (too few table rows, bad sizes)."""


class TokenizerError(EngramError):
    """A tokenizer is missing, unreadable or disagrees with the config."""


class ShardingError(EngramError):
    """A tensor-parallel size or rank that the head sharding cannot serve."""


class ValidationError(EngramError):
    """A batch (ids, positions, boundaries, history) that breaks the contract."""


class CheckpointError(EngramError):
    """A checkpoint tensor is missing or has the wrong shape or dtype."""


class CapacityError(EngramError):
    """Not enough memory or disk for the placement that was asked for."""


class LockTimeoutError(EngramError, TimeoutError):
    """A lock another process holds was not released within the wait allowed for it."""


class UntrustedFileError(EngramError):
    """A shared file belongs to a user this process does not trust, or others may write it."""


def expect(condition: bool, error: type[EngramError], message: str) -> None:
    """Raise ``error(message)`` when ``condition`` is false."""
    if not condition:
        raise error(message)


def describe_tensor(tensor: Any, *, device: bool = False) -> str:
    """``shape [...] dtype ...`` of a tensor (with ``device ...`` when asked), for the
    "found" half of an error message."""
    text = f"shape {list(tensor.shape)} dtype {tensor.dtype}"
    return f"{text} device {tensor.device}" if device else text


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """Raise :class:`ValidationError` naming ``name`` and ``value`` unless ``value`` is
    one of ``choices``."""
    if value not in choices:
        raise ValidationError(f"{name}={value!r}; expected one of {', '.join(choices)}")


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def os_error(what: str, exc: OSError) -> EngramError:
    """``exc`` as one line about ``what``: ``<what>: <reason> (<file>)``, a
    :class:`CapacityError` for a full disk or quota, else a :class:`ValidationError`
    (a permission, a read-only file system, a file where a directory should be)."""
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in _NO_SPACE:
        return CapacityError(f"{what}: {reason}{where}; free some space or choose another path")
    return ValidationError(f"{what}: {reason}{where}")
