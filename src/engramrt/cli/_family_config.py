"""``--config`` of the commands that serve any memory family: which family a preset or an
HF ``config.json`` describes, and that family's config and :class:`MemoryFamily` value.

The family is named by the registry (:func:`engramrt.family.family_of_config`: a
``model_type`` or fields only one family has); a file that carries no family's marks is
read as DeepSeek Engram, the family the presets and the earlier commands take, so its
errors stay the Engram config's ("lacks the field(s) ...").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from engramrt.errors import ConfigError, ValidationError

__all__ = [
    "FamilyConfig",
    "FamilyConfigOption",
    "engram_config",
    "family_config",
    "family_value",
    "load_family_config",
    "ple_config",
]

DEFAULT_FAMILY = "deepseek-engram"
"""The family of the presets, and of a config.json that carries no family's marks."""

FamilyConfigOption = Annotated[
    str,
    typer.Option(
        "--config",
        "-c",
        help="Preset or config.json / model dir: DeepSeek Engram or Qwen4-Exp (PLE).",
    ),
]
"""The ``--config`` option (``-c``) of every command that serves any family, read by
:func:`load_family_config`; each command gives its default."""


@dataclass(frozen=True)
class FamilyConfig:
    """A ``--config`` value resolved to a family.

    Attributes:
        option: the option it came from (``"--config"``), for messages.
        text: the value as given (a preset name, a config.json or a model directory).
        family: the registered family name (``"deepseek-engram"``, ``"qwen4-ple"``).
        data: the parsed config.json, or None for a preset.
    """

    option: str
    text: str
    family: str
    data: Mapping[str, Any] | None


def load_family_config(option: str, text: str) -> FamilyConfig:
    """Resolve ``text`` (a preset, a config.json or a model directory) to its family.

    A preset, or a path that is not a file (whose error the Engram config loader gives,
    as before), is DeepSeek Engram; a file is read once and its family detected.
    """
    from engramrt._io import read_json
    from engramrt.config import PRESETS
    from engramrt.family import family_of_config

    if text in PRESETS:
        return FamilyConfig(option, text, DEFAULT_FAMILY, None)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return FamilyConfig(option, text, DEFAULT_FAMILY, None)
    what = f"{option}={text!r}"
    data = read_json(path, ConfigError, f"config file {str(path)!r}")
    family = family_of_config(data, what=what) if isinstance(data, Mapping) else None
    return FamilyConfig(option, text, family or DEFAULT_FAMILY, data)


def engram_config(loaded: FamilyConfig) -> Any:
    """The :class:`~engramrt.config.EngramConfig` of a DeepSeek Engram ``--config``."""
    from engramrt.config import load_config

    return load_config(loaded.text)


def ple_config(loaded: FamilyConfig) -> Any:
    """The :class:`~engramrt.families.qwen4_ple.config.PleConfig` of a Qwen4-Exp
    ``--config``, refused unless PLE is on (a row id needs at least one PLE layer)."""
    from engramrt.families.qwen4_ple.config import PleConfig

    assert loaded.data is not None  # a Qwen4-Exp config is always a file
    try:
        config = PleConfig.from_hf(loaded.data)
    except ConfigError as exc:
        raise ConfigError(f"{loaded.option}={loaded.text!r}: {exc}") from exc
    if not config.enabled:
        text_config = loaded.data.get("text_config")
        fields = text_config if isinstance(text_config, Mapping) else loaded.data
        found = (
            f"ple_layer_ids={json.dumps(fields['ple_layer_ids'])}"
            if "ple_layer_ids" in fields
            else "no ple_layer_ids"
        )
        raise ConfigError(
            f"{loaded.option}={loaded.text!r} has {found} (PLE off); expected a list of at "
            f"least one one-indexed decoder layer with PLE, e.g. [2]"
        )
    return config


_OWN_HOOKS = {"qwen4-ple": "engramrt.cli.family_ple"}
"""The command-line hooks of engramrt's own families beside DeepSeek Engram (whose
commands are the CLI's own); other families name theirs when they register."""


def family_hook(loaded: FamilyConfig, hook: str, command: str) -> Callable[..., Any]:
    """Hook ``hook`` of the family of ``loaded`` (:func:`engramrt.family.command_line_hooks`);
    the error says which command the family does not serve."""
    import importlib

    from engramrt.family import command_line_hooks

    own = _OWN_HOOKS.get(loaded.family)
    hooks = importlib.import_module(own) if own else command_line_hooks(loaded.family)
    found = getattr(hooks, hook, None) if hooks is not None else None
    if not callable(found):
        raise ValidationError(
            f"{loaded.option}={loaded.text!r} is a {loaded.family!r} config, and that family "
            f"gives {command} no {hook}() (its command-line hooks: "
            f"{'none' if hooks is None else hooks.__name__})"
        )
    return found


def family_config(loaded: FamilyConfig) -> Any:
    """The config object the family's class is built from: DeepSeek Engram's
    :class:`~engramrt.config.EngramConfig`, else the family's ``read_config`` hook."""
    if loaded.family == DEFAULT_FAMILY:
        return engram_config(loaded)
    return family_hook(loaded, "read_config", "the command line")(loaded)


def family_value(loaded: FamilyConfig) -> Any:
    """The :class:`~engramrt.family.MemoryFamily` of ``loaded`` (its tables, roles, ...)."""
    from engramrt.family import resolve_family

    return resolve_family(loaded.family)(family_config(loaded))
