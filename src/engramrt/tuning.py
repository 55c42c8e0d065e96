"""Tuned kernel settings as data: one JSON file per kernel and device, read by one function.

The files live in ``engramrt/tuned/``, named ``<kernel>.<device>.json`` where
``<device>`` is the GPU's name as torch reports it with every run of
characters other than letters and digits made one ``_`` (``NVIDIA H200`` ->
``NVIDIA_H200``, :func:`normalize_device_name`); ``<kernel>.default.json``
serves every device without a file of its own (and the CPU, where kernels run
through Triton's interpreter). A device's file replaces the default file
whole. The tuning bench writes them (``engramrt bench --write-config DIR``,
``bench/tune_gate.py --write-config DIR``); the measurements behind the
shipped files are in BENCHMARKS.md, linked from each file's ``measured``
field.

A file::

    {
      "kernel": "ngram_hash",
      "device": "NVIDIA H200",
      "key": ["num_tokens"],
      "measured": "BENCHMARKS.md#hash",
      "entries": [
        {"match": {"num_tokens": {"max": 1024}}, "config": {"block_t": 16, "num_warps": 4}},
        {"match": {}, "config": {"block_t": 64, "num_warps": 4}}
      ]
    }

An entry matches a lookup key when every field of its ``match`` does: a
plain value matches an equal key value, ``{"max": n}`` a key value ``<= n``
(a shape bucket); a field missing from the key (or None) matches neither.
The first matching entry wins; its ``config`` holds the fields of the
kernel's frozen config type (fields left out take the type's defaults).

Each kernel's config type registers itself with :func:`register_tuned`; the
module defining it is imported on first use. This module imports neither
torch nor Triton until a torch device is given.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from engramrt.errors import EngramError, ValidationError

__all__ = [
    "DEFAULT_DEVICE",
    "TUNED_DIR",
    "TunedConfigError",
    "TunedConfigWarning",
    "TunedEntry",
    "cached_choice",
    "clear_cache",
    "config_type",
    "device_name",
    "load_tuned_file",
    "normalize_device_name",
    "register_tuned",
    "tuned_config",
    "tuned_file",
    "write_tuned_config",
]

TUNED_DIR = Path(__file__).parent / "tuned"
"""Where the shipped files live (package data)."""

DEFAULT_DEVICE = "default"
"""The ``<device>`` part of the file for devices without a file of their own."""

# Kernel name -> the module that defines and registers its config type.
_HOMES = {
    "ngram_hash": "engramrt.hashing.config",
    "lookup_rows": "engramrt.lookup.settings",
    "engram_gate": "engramrt.gate.config",
}
_TYPES: dict[str, type] = {}

C = TypeVar("C", bound=type)
F = TypeVar("F", bound=Callable[..., Any])
_CHOICE_CACHES: list[Any] = []


class TunedConfigError(EngramError):
    """A tuned-config file is missing, unreadable or malformed (the message names
    the file and the field)."""


class TunedConfigWarning(UserWarning):
    """A tuned-config file is damaged and was set aside: the launch uses the default
    file, or the kernel's built-in rule (the message names the file and the field)."""


def register_tuned(kernel: str) -> Callable[[C], C]:
    """Class decorator: ``cls`` (a frozen dataclass) is the config type of ``kernel``'s files."""

    def decorate(cls: C) -> C:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to hold {kernel!r} settings")
        _TYPES[kernel] = cls
        return cls

    return decorate


def config_type(kernel: str) -> type:
    """The frozen config class registered for ``kernel`` (:func:`register_tuned`), importing
    the module that registers it when needed."""
    if kernel not in _TYPES and kernel in _HOMES:
        importlib.import_module(_HOMES[kernel])
    if kernel not in _TYPES:
        known = sorted(set(_TYPES) | set(_HOMES))
        raise ValidationError(f"kernel = {kernel!r}; expected one of {', '.join(known)}")
    return _TYPES[kernel]


def normalize_device_name(name: str) -> str:
    """``name`` as it appears in a file name: runs of other characters than letters and
    digits become one ``_`` (``"NVIDIA H200"`` -> ``"NVIDIA_H200"``)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or DEFAULT_DEVICE


@functools.lru_cache(maxsize=64)
def _cuda_device_name(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_name(index))


def device_name(device: Any) -> str:
    """The name that picks a device's file: a CUDA device's name as torch reports it,
    :data:`DEFAULT_DEVICE` for any other device or None; a ``str`` is taken as a device
    name already (``"NVIDIA H200"``)."""
    if device is None:
        return DEFAULT_DEVICE
    if isinstance(device, str):
        return device
    if getattr(device, "type", None) == "cuda":
        if device.index is None:
            import torch

            return _cuda_device_name(torch.cuda.current_device())
        return _cuda_device_name(device.index)
    return DEFAULT_DEVICE


def tuned_file(kernel: str, device: Any = None, directory: Path | None = None) -> Path:
    """The file that serves ``kernel`` on ``device``: its own when ``directory`` (default
    :data:`TUNED_DIR`) has one, else the default file."""
    directory = TUNED_DIR if directory is None else Path(directory)
    own = directory / f"{kernel}.{normalize_device_name(device_name(device))}.json"
    return own if own.is_file() else directory / f"{kernel}.{DEFAULT_DEVICE}.json"


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One entry of a file: the key fields it matches and the config it gives."""

    match: Mapping[str, Any]
    config: Any

    def matches(self, key: Mapping[str, Any]) -> bool:
        for field, want in self.match.items():
            value = key.get(field)
            if value is None:
                return False
            if isinstance(want, dict):
                if not value <= want["max"]:
                    return False
            elif value != want:
                return False
        return True


def _fail(path: Path, field: str, message: str) -> TunedConfigError:
    return TunedConfigError(f"{path}: {field}: {message}")


def _parse_match(path: Path, where: str, match: Any, key_fields: Sequence[str]) -> dict[str, Any]:
    if not isinstance(match, dict):
        raise _fail(path, where, f"{match!r}; expected an object of key fields")
    for field, want in match.items():
        if field not in key_fields:
            raise _fail(
                path, f"{where}.{field}", f"not a key field; expected one of {list(key_fields)}"
            )
        if isinstance(want, dict):
            bound = want.get("max")
            if set(want) != {"max"} or isinstance(bound, bool) or not isinstance(bound, int):
                raise _fail(path, f"{where}.{field}", f"{want!r}; expected {{'max': <int>}}")
        elif isinstance(want, (list, float)) or want is None:
            raise _fail(path, f"{where}.{field}", f"{want!r}; expected an int, a str or a bool")
    return match


def _parse_config(path: Path, where: str, cls: type, fields: Any) -> Any:
    if not isinstance(fields, dict):
        raise _fail(path, where, f"{fields!r}; expected an object of {cls.__name__} fields")
    names = [f.name for f in dataclasses.fields(cls)]
    for name in fields:
        if name not in names:
            raise _fail(path, f"{where}.{name}", f"not a field of {cls.__name__}; expected {names}")
    try:
        return cls(**fields)
    except (ValidationError, TypeError, ValueError) as exc:
        raise _fail(path, where, str(exc)) from exc


@functools.lru_cache(maxsize=64)
def _load(kernel: str, path: Path) -> tuple[TunedEntry, ...]:
    cls = config_type(kernel)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TunedConfigError(
            f"{path}: no such file; every kernel ships a {kernel}.{DEFAULT_DEVICE}.json"
        ) from None
    except (OSError, ValueError) as exc:
        raise TunedConfigError(f"{path}: not readable as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _fail(path, "(top level)", "expected an object")
    if data.get("kernel") != kernel:
        raise _fail(path, "kernel", f"{data.get('kernel')!r}; expected {kernel!r}")
    key_fields = data.get("key")
    if not isinstance(key_fields, list) or not all(isinstance(k, str) for k in key_fields):
        raise _fail(path, "key", f"{key_fields!r}; expected a list of field names")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise _fail(path, "entries", f"{entries!r}; expected a list")
    parsed = []
    for i, entry in enumerate(entries):
        where = f"entries[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"match", "config"}:
            raise _fail(path, where, f"{entry!r}; expected an object with 'match' and 'config'")
        match = _parse_match(path, f"{where}.match", entry["match"], key_fields)
        config = _parse_config(path, f"{where}.config", cls, entry["config"])
        parsed.append(TunedEntry(match, config))
    # Checked last, so that a file's structure is reported first. The field must name
    # the device the file is named for: a file copied from another GPU's name would
    # serve that GPU's measurements here.
    named_for = path.name[len(kernel) + 1 : -len(".json")]
    device = data.get("device")
    if not isinstance(device, str) or normalize_device_name(device) != named_for:
        raise _fail(
            path,
            "device",
            f"{device!r}; expected the device the file is named for "
            f"({named_for!r}, as normalize_device_name gives it)",
        )
    return tuple(parsed)


def load_tuned_file(kernel: str, path: Path) -> tuple[TunedEntry, ...]:
    """The entries of one tuned file, checked field by field.

    Raises:
        TunedConfigError: the file is missing, not JSON or malformed; the
            message names the file and the field.
    """
    return _load(kernel, Path(path))


@functools.lru_cache(maxsize=64)
def _usable_entries(kernel: str, path: Path) -> tuple[TunedEntry, ...] | None:
    """``path``'s entries, or None (with a :class:`TunedConfigWarning`, once per file
    until :func:`clear_cache`) when the file is damaged: the caller then falls back."""
    try:
        return _load(kernel, path)
    except TunedConfigError as exc:
        shipped_default = TUNED_DIR / f"{kernel}.{DEFAULT_DEVICE}.json"
        fallback = (
            f"the default file {shipped_default}"
            if path != shipped_default
            else f"the built-in choice ({config_type(kernel).__name__})"
        )
        warnings.warn(
            f"{exc}; the file is set aside and {fallback} serves instead",
            TunedConfigWarning,
            stacklevel=5,
        )
        return None


@functools.lru_cache(maxsize=4096)
def _lookup(kernel: str, name: str, key: tuple[tuple[str, Any], ...]) -> Any:
    path = tuned_file(kernel, name)
    entries = _usable_entries(kernel, path)
    shipped_default = TUNED_DIR / f"{kernel}.{DEFAULT_DEVICE}.json"
    if entries is None and path != shipped_default:
        entries = _usable_entries(kernel, shipped_default)
    if entries is None:
        return None  # the caller's built-in rule
    fields = dict(key)
    return next((entry.config for entry in entries if entry.matches(fields)), None)


def tuned_config(kernel: str, device: Any, key: Mapping[str, Any]) -> Any:
    """The tuned config of ``kernel`` on ``device`` for ``key``, or None when no entry matches.

    Args:
        kernel: ``"ngram_hash"``, ``"lookup_rows"`` or ``"engram_gate"``.
        device: a ``torch.device``, a device name (``"NVIDIA H200"``) or None
            (the default file).
        key: the shape the launch is for (``{"num_tokens": 256}``); fields
            no entry names are ignored.

    Returns:
        An instance of the kernel's config type (the same object for the
        same file and entry), or None (the caller's built-in rule). Files
        are read once and cached.

    A damaged file (missing, not JSON, or any field out of range: a
    ``block_d`` that is no power of two, ``num_warps`` 3, a flag given as
    ``"false"`` or ``0``, a ``device`` field naming another GPU) is set aside
    with a :class:`TunedConfigWarning` naming the file and the field: a
    device's own file falls back to the default file, the default file to
    None. :func:`load_tuned_file` raises :class:`TunedConfigError` instead.
    """
    return _lookup(kernel, device_name(device), tuple(key.items()))


def _config_fields(config: Any) -> dict[str, Any]:
    """Every field of ``config``: a file says all it chose, whatever the type's defaults."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def write_tuned_config(
    kernel: str,
    device: str,
    key_fields: Sequence[str],
    entries: Sequence[tuple[Mapping[str, Any], Any]],
    directory: Path,
    measured: str | None = None,
) -> Path:
    """Write ``entries`` into ``directory``'s file of ``kernel`` for ``device`` (atomically).

    ``entries`` are ``(match, config)`` pairs. The file starts as the one that
    serves that device today (``directory``'s own or default file, else the
    shipped one); an entry with the same ``match`` as a new one is replaced
    in place, the others are kept, and a new one goes before the first entry
    that matches every key it does (a narrower bucket before a wider one),
    else last. Returns the path.
    """
    from engramrt._io import atomic_write_bytes

    cls = config_type(kernel)
    directory = Path(directory)
    current = tuned_file(kernel, device, directory)
    if not current.is_file():
        current = tuned_file(kernel, device)
    if current.is_file():
        old = json.loads(current.read_text())
        _load(kernel, current)  # refuse to build on a malformed file
    else:
        old = {"key": list(key_fields), "entries": []}
    merged: list[dict[str, Any]] = [dict(e) for e in old["entries"]]
    for match, config in entries:
        if not isinstance(config, cls):
            raise ValidationError(f"config = {config!r}; expected a {cls.__name__}")
        new = {"match": dict(match), "config": _config_fields(config)}
        same = [i for i, e in enumerate(merged) if e["match"] == new["match"]]
        wider = [i for i, e in enumerate(merged) if _covers(e["match"], new["match"])]
        if same:
            merged[same[0]] = new
        elif wider:
            merged.insert(wider[0], new)
        else:
            merged.append(new)
    data = {
        "kernel": kernel,
        "device": device,
        "key": list(dict.fromkeys([*old["key"], *key_fields])),
        "measured": measured or old.get("measured", "BENCHMARKS.md"),
        "entries": merged,
    }
    path = directory / f"{kernel}.{normalize_device_name(device)}.json"
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())
    clear_cache()
    return path


def _covers(wide: Mapping[str, Any], narrow: Mapping[str, Any]) -> bool:
    """Whether every key that ``narrow`` matches, ``wide`` matches too."""
    for field, want in wide.items():
        if field not in narrow:
            return False
        have = narrow[field]
        if isinstance(want, dict):
            bound = have["max"] if isinstance(have, dict) else have
            if bound > want["max"]:
                return False
        elif have != want:
            return False
    return True


def cached_choice(function: F) -> F:
    """Memoise a launch path's choice (hashable arguments: shapes, a device), so a
    step pays one dictionary lookup; :func:`clear_cache` forgets it with the files."""
    memoised = functools.lru_cache(maxsize=4096)(function)
    _CHOICE_CACHES.append(memoised)
    return cast(F, memoised)


def clear_cache() -> None:
    """Forget every file read so far, and every choice made from them (after a file
    changed on disk)."""
    _load.cache_clear()
    _usable_entries.cache_clear()
    _lookup.cache_clear()
    for memoised in _CHOICE_CACHES:
        memoised.cache_clear()
