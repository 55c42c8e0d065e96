"""Which checkpoint tensor holds which Engram table.

Three roles, each resolved per Engram layer:

=========  =====================================================  ==============================
role       what the tensor holds                                  default name(s)
=========  =====================================================  ==============================
weight     fp8 e4m3fn values ``[num_embeddings, E]``              :data:`DEFAULT_WEIGHT_NAMES`
scale      ue8m0 scale bytes ``[num_embeddings, E/32]``           :data:`DEFAULT_SCALE_NAMES`
           (stored as float8_e8m0fnu or uint8: the same bytes)
source     a float table (bf16/fp16/fp32) ``[num_embeddings, E]``  :data:`DEFAULT_SOURCE_NAMES`
           to quantise (``engramrt convert``)
=========  =====================================================  ==============================

The defaults are the names DeepSeek-V4.1 checkpoints use, so a real
checkpoint loads with no name arguments. Per Engram block ``{layer}``:

- weight: ``layers.{layer}.engram.embed.weight``;
- scale: ``layers.{layer}.engram.embed.weight_scale_inv`` (Hugging Face
  files) or ``layers.{layer}.engram.embed.scale`` (DeepSeek's own
  inference format);
- source: the same ``embed.weight`` name in a float checkpoint, then where
  DeepSeek's Engram demo code keeps its table (the ``nn.Embedding`` inside
  ``Engram.multi_head_embedding``), then a flat ``engram.{layer}.weight``;

each also with a ``model.`` prefix (Hugging Face layout). The first name
of each role is the one ``engramrt convert`` and :func:`save_tables`
write. Override any role with:

- a format string, e.g. ``"blocks.{layer}.engram.table.weight"``:
  ``{layer}`` is the backbone block index (an entry of
  ``engram_layer_ids``), ``{index}`` the position of that layer in the list;
- a list of format strings, tried in order (the first that exists is read;
  the first one is the name written);
- a mapping from layer id to exact tensor name, e.g. ``{1: "a", 14: "b"}``
  (JSON keys may be strings: ``{"1": "a", "14": "b"}``).

``engramrt convert --names names.json`` reads the same structure from a
JSON object, e.g. ``{"source": "engram.{index}.weight", "weight": ...}``;
roles it leaves out keep their defaults.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_SCALE_NAME",
    "DEFAULT_SCALE_NAMES",
    "DEFAULT_SOURCE_NAMES",
    "DEFAULT_WEIGHT_NAME",
    "DEFAULT_WEIGHT_NAMES",
    "ENGRAM_PREFIXES",
    "ROLES",
    "TensorNames",
    "head_name_templates",
    "load_names",
]

ENGRAM_PREFIXES = ("", "model.")
"""Prefixes a checkpoint puts before ``layers.{layer}.engram.``: none, or ``model.`` (HF)."""


def _prefixed(*suffixes: str) -> tuple[str, ...]:
    """``layers.{layer}.engram.<suffix>`` under every prefix, suffix-major order."""
    return tuple(
        f"{prefix}layers.{{layer}}.engram.{suffix}"
        for suffix in suffixes
        for prefix in ENGRAM_PREFIXES
    )


DEFAULT_WEIGHT_NAMES = _prefixed("embed.weight")
"""Names of a layer's fp8 table ``[num_embeddings, E]``, tried in order; the first is written."""

DEFAULT_SCALE_NAMES = _prefixed("embed.weight_scale_inv", "embed.scale")
"""Names of a layer's ue8m0 scales ``[num_embeddings, E/32]``, tried in order."""

DEFAULT_SOURCE_NAMES = (
    *_prefixed("embed.weight", "multi_head_embedding.embedding.weight"),
    "engram.{layer}.weight",
)
"""Names of a layer's float table, tried in order."""

DEFAULT_WEIGHT_NAME = DEFAULT_WEIGHT_NAMES[0]
"""The fp8 table name written: ``layers.{layer}.engram.embed.weight``."""

DEFAULT_SCALE_NAME = DEFAULT_SCALE_NAMES[0]
"""The scale name written: ``layers.{layer}.engram.embed.weight_scale_inv``."""

DEFAULT_HEAD_NAMES: dict[str, tuple[str, ...]] = {
    "wkv": _prefixed("wkv.weight"),
    "wkv_scale": _prefixed("wkv.weight_scale_inv", "wkv.scale"),
    "q_weight": _prefixed("q_weight"),
    "k_weight": _prefixed("k_weight"),
}
"""Names of a layer's head weights (:meth:`EngramHead.load_weights` arguments), tried in order:
``wkv`` ``[(hc+1)*D, C*E]`` bf16 or fp8 with its block scales ``wkv_scale``
(``weight_scale_inv`` in HF files, ``scale`` in DeepSeek's format), and the
gate's ``q_weight``, ``k_weight`` ``[hc, D]`` bf16."""

ROLES = ("weight", "scale", "source")

_FIELDS = frozenset({"layer", "index"})

NameRule = tuple[str, ...] | Mapping[int, str]
"""Format strings tried in order, or exact names keyed by layer id."""


def _check_template(role: str, template: Any, label: str | None = None) -> str:
    label = f"names.{role}" if label is None else label
    if not isinstance(template, str) or not template:
        raise CheckpointError(
            f"{label} = {template!r}; expected a non-empty tensor name or format string"
        )
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise CheckpointError(f"{label} = {template!r} is not a format string: {exc}") from exc
    unknown = fields - _FIELDS
    if unknown:
        raise CheckpointError(
            f"{label} = {template!r} uses the field(s) {sorted(unknown)}; expected only "
            f"{{layer}} (block index) and {{index}} (position in engram_layer_ids)"
        )
    return template


def _layer_key(role: str, key: Any) -> int:
    if isinstance(key, bool):
        raise CheckpointError(f"names.{role} has the key {key!r}; expected a layer id")
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise CheckpointError(f"names.{role} has the key {key!r}; expected a layer id (an integer)")


def _rule(role: str, value: Any) -> NameRule:
    """Normalise one role's override to a tuple of templates or an id -> name mapping."""
    if isinstance(value, str):
        return (_check_template(role, value),)
    if isinstance(value, Mapping):
        rule: dict[int, str] = {}
        for key, name in value.items():
            if not isinstance(name, str) or not name:
                raise CheckpointError(
                    f"names.{role}[{key!r}] = {name!r}; expected a non-empty tensor name"
                )
            rule[_layer_key(role, key)] = name
        if not rule:
            raise CheckpointError(f"names.{role} = {{}}; expected at least one layer's name")
        return rule
    if isinstance(value, Sequence) and value:
        return tuple(_check_template(role, t) for t in value)
    raise CheckpointError(
        f"names.{role} = {value!r}; expected a format string, a list of them, or a mapping "
        f"from layer id to tensor name"
    )


@dataclass(frozen=True)
class TensorNames:
    """Tensor names per role (``weight``, ``scale``, ``source``); see the module docstring."""

    weight: NameRule = field(default=DEFAULT_WEIGHT_NAMES)
    scale: NameRule = field(default=DEFAULT_SCALE_NAMES)
    source: NameRule = field(default=DEFAULT_SOURCE_NAMES)

    def __post_init__(self) -> None:
        for role in ROLES:
            object.__setattr__(self, role, _rule(role, getattr(self, role)))

    @classmethod
    def from_spec(
        cls, spec: TensorNames | Mapping[str, Any] | str | os.PathLike[str] | None
    ) -> TensorNames:
        """Names from ``None`` (defaults), a mapping of role overrides or a JSON file of one."""
        if spec is None:
            return cls()
        if isinstance(spec, TensorNames):
            return spec
        if isinstance(spec, (str, os.PathLike)):
            return load_names(spec)
        if not isinstance(spec, Mapping):
            raise CheckpointError(
                f"names = {spec!r}; expected a mapping of role -> name(s) or a JSON file path"
            )
        unknown = sorted(set(spec) - set(ROLES))
        if unknown:
            raise CheckpointError(
                f"names has the role(s) {unknown}; expected only {', '.join(ROLES)}"
            )
        return cls(**{role: spec[role] for role in ROLES if role in spec})

    def candidates(self, role: str, layer_id: int, layer_index: int) -> tuple[str, ...]:
        """The names to try, in order, for ``role`` of Engram layer ``layer_id``."""
        if role not in ROLES:
            raise CheckpointError(f"role = {role!r}; expected one of {', '.join(ROLES)}")
        rule = getattr(self, role)
        if isinstance(rule, Mapping):
            if layer_id not in rule:
                raise CheckpointError(
                    f"names.{role} has no entry for layer {layer_id}; it names layers "
                    f"{sorted(rule)}"
                )
            return (rule[layer_id],)
        return tuple(t.format(layer=layer_id, index=layer_index) for t in rule)

    def per_layer(self, role: str, config: EngramConfig) -> list[tuple[str, ...]]:
        """:meth:`candidates` for every layer of ``config``; refuses two layers sharing a name."""
        names = [
            self.candidates(role, layer_id, index)
            for index, layer_id in enumerate(config.layer_ids)
        ]
        depth = min(len(n) for n in names)
        for k in range(depth):
            seen: dict[str, int] = {}
            for layer_id, layer_names in zip(config.layer_ids, names, strict=True):
                other = seen.setdefault(layer_names[k], layer_id)
                if other != layer_id:
                    raise CheckpointError(
                        f"names.{role} maps layers {other} and {layer_id} to the same tensor "
                        f"{layer_names[k]!r}; expected one tensor per layer (use {{layer}})"
                    )
        return names

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (mapping keys as strings), accepted back by :meth:`from_spec`."""
        out: dict[str, Any] = {}
        for role in ROLES:
            rule = getattr(self, role)
            out[role] = (
                {str(k): v for k, v in rule.items()} if isinstance(rule, Mapping) else list(rule)
            )
        return out


def head_name_templates(
    overrides: Mapping[str, str | Sequence[str]] | None,
) -> dict[str, tuple[str, ...]]:
    """:data:`DEFAULT_HEAD_NAMES` with ``overrides`` (role -> a format string or a list of them).

    Raises:
        CheckpointError: an unknown role, or a value that is not a non-empty
            name or list of names (naming the role and the value).
    """
    unknown = sorted(set(overrides or {}) - set(DEFAULT_HEAD_NAMES))
    if unknown:
        raise CheckpointError(
            f"weight_names has the role(s) {unknown}; expected only {', '.join(DEFAULT_HEAD_NAMES)}"
        )
    templates = dict(DEFAULT_HEAD_NAMES)
    for role, value in (overrides or {}).items():
        if isinstance(value, str) and value:
            templates[role] = (_check_template(role, value, f"weight_names[{role!r}]"),)
        elif (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and value
            and all(isinstance(v, str) and v for v in value)
        ):
            templates[role] = tuple(
                _check_template(role, v, f"weight_names[{role!r}]") for v in value
            )
        else:
            raise CheckpointError(
                f"weight_names[{role!r}] = {value!r}; expected a tensor name or format string, "
                f"or a non-empty list of them"
            )
    return templates


def load_names(path: str | os.PathLike[str]) -> TensorNames:
    """Read role overrides from a JSON object, e.g. ``{"source": "engram.{layer}.weight"}``."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"names file {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"names file {str(file)!r} cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"names file {str(file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise CheckpointError(
            f"names file {str(file)!r} holds a JSON {type(data).__name__}; expected an object "
            f"with keys among {', '.join(ROLES)}"
        )
    return TensorNames.from_spec(data)
