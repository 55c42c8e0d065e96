"""PLE configuration: the fields of a Qwen4-Exp ``config.json`` that per-layer n-gram
embeddings read (docs/families.md §1).

A :class:`PleConfig` says *what* the PLE layers compute: which decoder layers carry one,
the n-gram order and heads, the prime search that sizes each hash head, the multiplier
seed, the EOS id that ends a segment, and the sizes of the layer around the table. The
hash constants derived from it (multipliers, primes, offsets, table rows) live in
:class:`engramrt.families.qwen4_ple.ids.PleConstants`.

Validation mirrors ``Qwen4ExpTextConfig`` (transformers 5.23.0): integer fields are
integers, ``hc_count > 1``, ``layer_types`` names ``num_hidden_layers`` layers of the two
kinds Qwen4-Exp has, and the PLE checks (layer ids in range and on linear-attention
layers, ``ple_embed_dim`` a multiple of the head count, an EOS id) apply only when PLE is
on, as there. It is stricter where the reference accepts a value it then crashes on or
hashes into nonsense: every size (``ple_conv_kernel_size``, ``vocab_size``, the row
divisor, ...) is a positive integer, the EOS id is non-negative and ``rms_norm_eps`` is
finite and positive.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramrt._io import read_json
from engramrt.errors import ConfigError, ValidationError

__all__ = [
    "INDEXED_ATTENTION",
    "LAYER_TYPE_ALIASES",
    "LINEAR_ATTENTION",
    "PleConfig",
    "default_layer_types",
    "resolve_ple_config",
]

_INT64_MAX = 2**63 - 1

LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"

LAYER_TYPE_ALIASES: Mapping[str, str] = {
    "linear_attention": LINEAR_ATTENTION,
    "indexed_attention": INDEXED_ATTENTION,
    # Qwen4ExpTextConfig maps the checkpoint's "full_attention" to indexed attention, and
    # transformers' legacy remap renames these three before validation.
    "full_attention": INDEXED_ATTENTION,
    "mamba": LINEAR_ATTENTION,
    "qwen_sparse_attention": INDEXED_ATTENTION,
    "deepseek_sparse_attention": INDEXED_ATTENTION,
}
"""Every ``layer_types`` entry the reference accepts, and the kind it means. Anything
else (``"attention"``, which the legacy remap turns into ``"full_attention"`` *after*
Qwen4-Exp's own mapping, included) is refused, as the reference refuses it."""

_TOP_LEVEL_MODEL_TYPE = "qwen4_exp"
_TEXT_MODEL_TYPE = "qwen4_exp_text"

# Fields whose null in config.json means "the default" (the reference declares them
# Optional); a null anywhere else is refused like any other non-integer.
_NULLABLE_FIELDS = ("ple_layer_ids", "ple_embed_dim", "eos_token_id", "layer_types")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    if not 0 < value <= _INT64_MAX:
        raise ConfigError(f"{name}={value} must be a positive integer in [1, 2**63)")
    return int(value)


def default_layer_types(
    num_hidden_layers: int, full_attention_interval: int = 4
) -> tuple[str, ...]:
    """The reference's ``layer_types`` when a config gives none: every
    ``full_attention_interval``-th layer (one-indexed) indexed attention, the rest linear."""
    interval = _positive_int("full_attention_interval", full_attention_interval)
    return tuple(
        LINEAR_ATTENTION if (i + 1) % interval else INDEXED_ATTENTION
        for i in range(num_hidden_layers)
    )


def _eos_id(value: Any) -> int | None:
    """The PLE EOS id of an ``eos_token_id`` value: the int, element 0 of a list (the
    other entries are ordinary tokens for PLE), or ``None`` when unset (null or ``[]``)."""
    first = value
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not all(_is_int(v) for v in value):
            raise ConfigError(f"eos_token_id={value!r} must be an int or a list of ints")
        if not value:
            return None
        first = value[0]
    if first is None:
        return None
    if not _is_int(first) or not 0 <= first <= _INT64_MAX:
        raise ConfigError(
            f"eos_token_id={value!r} must be a non-negative integer (or a list whose first "
            f"entry is one)"
        )
    return int(first)


def _layer_types(value: Sequence[str] | None, num_hidden_layers: int) -> tuple[str, ...]:
    if value is None:
        return default_layer_types(num_hidden_layers)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"layer_types={value!r} must be a list of strings")
    kinds = []
    for i, entry in enumerate(value):
        if entry not in LAYER_TYPE_ALIASES:
            raise ConfigError(
                f"layer_types[{i}]={entry!r} is not a Qwen4-Exp layer type; expected one of "
                f"{', '.join(sorted(LAYER_TYPE_ALIASES))}"
            )
        kinds.append(LAYER_TYPE_ALIASES[entry])
    if len(kinds) != num_hidden_layers:
        raise ConfigError(
            f"layer_types has {len(kinds)} entries; expected num_hidden_layers={num_hidden_layers}"
        )
    return tuple(kinds)


def _ple_layer_ids(value: Any) -> tuple[int, ...]:
    """``sorted(set(value))`` as the reference loads it; ``None`` is ``()`` (PLE off)."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"ple_layer_ids={value!r} must be a list of ints")
    for i, layer_id in enumerate(value):
        if not _is_int(layer_id):
            raise ConfigError(f"ple_layer_ids[{i}]={layer_id!r} must be an integer")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class PleConfig:
    """The PLE fields of a Qwen4-Exp text config (docs/families.md §1), named as in ``config.json``.

    Construction normalises what the reference normalises (``ple_layer_ids`` to a sorted
    tuple without repeats, ``ple_embed_dim=None`` to ``hidden_size``, ``eos_token_id`` to
    the int or element 0 of a list, ``layer_types`` to ``linear_attention`` /
    ``indexed_attention``) and raises :class:`ConfigError` naming the field and value
    otherwise.

    Attributes:
        ple_layer_ids: one-indexed decoder layers with PLE; empty means PLE off (L = 0).
            PLE index ``l`` is the position in this tuple.
        ple_embed_dim: E, the concatenated n-gram embedding width of one layer.
        ngram_size: N, the largest n-gram order (and the conv dilation).
        heads_per_ngram: H, hash heads per order.
        ngram_vocab_size_base: where the prime search for head sizes starts.
        make_ngram_vocab_size_divisible_by: table rows are padded to a multiple of this.
        seed: multiplier seed (any integer; it is taken mod 2**64).
        split_ngram_parts: checkpoint shards per table (loading only).
        ple_conv_kernel_size: K, taps of the dilated causal conv.
        vocab_size: V, the model vocabulary (bounds the multipliers).
        eos_token_id: the PLE EOS id (ends a segment, fills the start context); ``None``
            only when PLE is off.
        hidden_size: D. hc_count: hyper-connection streams. rms_norm_eps: eps of the
            layer's three group RMSNorms.
        num_hidden_layers: decoder layers. layer_types: kind of each decoder layer.
    """

    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int | None = None
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    ple_conv_kernel_size: int = 4
    vocab_size: int = 248_320
    eos_token_id: int | None = None
    hidden_size: int = 2048
    hc_count: int = 4
    rms_norm_eps: float = 1e-6
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in (
            "ngram_size",
            "heads_per_ngram",
            "ngram_vocab_size_base",
            "make_ngram_vocab_size_divisible_by",
            "split_ngram_parts",
            "ple_conv_kernel_size",
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
        ):
            _positive_int(name, getattr(self, name))
        if not _is_int(self.hc_count) or self.hc_count <= 1:
            raise ConfigError(f"hc_count={self.hc_count!r} must be an integer > 1 (Qwen4-Exp)")
        if not _is_int(self.seed):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ConfigError(f"rms_norm_eps={eps!r} must be a finite positive number")
        embed_dim = self.hidden_size if self.ple_embed_dim is None else self.ple_embed_dim
        object.__setattr__(self, "ple_embed_dim", _positive_int("ple_embed_dim", embed_dim))
        object.__setattr__(self, "ple_layer_ids", _ple_layer_ids(self.ple_layer_ids))
        object.__setattr__(self, "eos_token_id", _eos_id(self.eos_token_id))
        object.__setattr__(
            self, "layer_types", _layer_types(self.layer_types, self.num_hidden_layers)
        )
        if self.ple_layer_ids:
            self._check_ple()

    def _check_ple(self) -> None:
        """The reference's checks that apply only when PLE is on."""
        if self.ngram_size < 2:
            raise ConfigError(
                f"ngram_size={self.ngram_size} must be at least 2 when PLE is on (bigrams)"
            )
        if self.embed_dim % self.n_cols:
            raise ConfigError(
                f"ple_embed_dim={self.embed_dim} must be a multiple of the n-gram head count "
                f"C = (ngram_size - 1) * heads_per_ngram = {self.n_cols}"
            )
        for layer_id in self.ple_layer_ids:
            if not 1 <= layer_id <= self.num_hidden_layers:
                raise ConfigError(
                    f"ple_layer_ids has {layer_id}; expected one-indexed ids in "
                    f"[1, num_hidden_layers={self.num_hidden_layers}]"
                )
            kind = self.kinds[layer_id - 1]
            if kind != LINEAR_ATTENTION:
                raise ConfigError(
                    f"ple_layer_ids has {layer_id}, whose layer_types entry is {kind!r}; "
                    f"PLE runs only on {LINEAR_ATTENTION!r} layers"
                )
        if self.eos_token_id is None:
            raise ConfigError(
                "eos_token_id=None (null or []) must be set when PLE is on "
                f"(ple_layer_ids={list(self.ple_layer_ids)})"
            )

    # Normalised views (for the type checker: __post_init__ fills these) ----------------
    @property
    def embed_dim(self) -> int:
        """E = ``ple_embed_dim`` (``hidden_size`` when the file left it null)."""
        assert self.ple_embed_dim is not None
        return self.ple_embed_dim

    @property
    def kinds(self) -> tuple[str, ...]:
        """``layer_types`` after normalisation: one of ``linear_attention`` /
        ``indexed_attention`` per decoder layer."""
        assert self.layer_types is not None
        return self.layer_types

    @property
    def eos(self) -> int:
        """The PLE EOS id; raises :class:`ConfigError` when PLE is off and none was set."""
        if self.eos_token_id is None:
            raise ConfigError("eos_token_id is not set (PLE is off); the row ids need one")
        return self.eos_token_id

    # Derived sizes ---------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self.ple_layer_ids)

    @property
    def n_layers(self) -> int:
        """L, the number of PLE layers (0: PLE off)."""
        return len(self.ple_layer_ids)

    @property
    def n_cols(self) -> int:
        """C = (N - 1) * H hash heads (table columns groups) per PLE layer."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def table_width(self) -> int:
        """d = E / C, the width of one table row (one head's slice of the embedding)."""
        return self.embed_dim // self.n_cols

    @property
    def context_len(self) -> int:
        """N - 1, the raw ids a request carries between chunks for its row ids."""
        return self.ngram_size - 1

    @property
    def conv_state_len(self) -> int:
        """S = (K - 1) * N, the conv inputs a request carries per PLE layer."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def decoder_layer_indices(self) -> tuple[int, ...]:
        """Zero-based decoder layer of each PLE layer, in PLE index order (``id - 1``)."""
        return tuple(layer_id - 1 for layer_id in self.ple_layer_ids)

    # Conversions -----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: Mapping[str, Any] | str | Path) -> PleConfig:
        """A config from an HF ``config.json``: a dict, a file or a model directory.

        Takes the top-level ``qwen4_exp`` config's ``text_config`` (a composite
        ``Qwen4ExpForConditionalGeneration`` checkpoint) or the text config itself
        (``qwen4_exp_text``, a ``Qwen4ExpForCausalLM`` checkpoint). Fields the PLE does
        not read are ignored; absent or null fields take the reference's defaults.
        """
        if isinstance(source, Mapping):
            return cls._from_text_config(_text_config(source, "config"))
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = read_json(path, ConfigError, f"config file {str(path)!r}")
        return cls._from_text_config(_text_config(data, f"config file {str(path)!r}"))

    @classmethod
    def _from_text_config(cls, data: Mapping[str, Any]) -> PleConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {
            name: data[name]
            for name in names
            if name in data and not (data[name] is None and name in _NULLABLE_FIELDS)
        }
        if kwargs.get("layer_types") is None:
            num_layers = _positive_int(
                "num_hidden_layers", kwargs.get("num_hidden_layers", cls.num_hidden_layers)
            )
            kwargs["layer_types"] = default_layer_types(
                num_layers, data.get("full_attention_interval", 4)
            )
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The text-config fields of this config, as ``config.json`` writes them
        (round-trips through :meth:`from_hf`; ``Qwen4ExpTextConfig(**d)`` accepts it)."""
        return {
            "model_type": _TEXT_MODEL_TYPE,
            "ple_layer_ids": list(self.ple_layer_ids),
            "ple_embed_dim": self.embed_dim,
            "ngram_size": self.ngram_size,
            "heads_per_ngram": self.heads_per_ngram,
            "ngram_vocab_size_base": self.ngram_vocab_size_base,
            "make_ngram_vocab_size_divisible_by": self.make_ngram_vocab_size_divisible_by,
            "seed": self.seed,
            "split_ngram_parts": self.split_ngram_parts,
            "ple_conv_kernel_size": self.ple_conv_kernel_size,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "hidden_size": self.hidden_size,
            "hc_count": self.hc_count,
            "rms_norm_eps": self.rms_norm_eps,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.kinds),
        }

    def replace(self, **changes: Any) -> PleConfig:
        """A copy with ``changes``, validated again. The other fields keep their
        normalised values: ``ple_embed_dim`` stays what it resolved to (change it with
        ``hidden_size`` when both should move) and ``layer_types`` its length."""
        return dataclasses.replace(self, **changes)


def resolve_ple_config(config: PleConfig | Mapping[str, Any] | str | Path) -> PleConfig:
    """``config`` as a :class:`PleConfig` (an HF ``config.json`` object or path through
    :meth:`PleConfig.from_hf`), refused with :class:`ValidationError` when PLE is off: what
    every object that computes a PLE layer takes (``ple_layer_ids`` not empty)."""
    if not isinstance(config, PleConfig):
        config = PleConfig.from_hf(config)
    if not config.enabled:
        raise ValidationError(
            "config has ple_layer_ids=[] (PLE off); expected at least one PLE layer"
        )
    return config


def _text_config(data: Any, what: str) -> Mapping[str, Any]:
    """The text config inside an HF config: ``text_config`` of a ``qwen4_exp`` config
    (defaults when it has none, as the reference builds them), else the dict itself."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a JSON object; got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in (None, _TOP_LEVEL_MODEL_TYPE, _TEXT_MODEL_TYPE):
        raise ConfigError(
            f"{what} has model_type={model_type!r}; expected {_TOP_LEVEL_MODEL_TYPE!r} "
            f"(with a text_config) or {_TEXT_MODEL_TYPE!r}"
        )
    if model_type == _TEXT_MODEL_TYPE or (model_type is None and "text_config" not in data):
        return data
    text = data.get("text_config")
    if text is None:
        return {}
    if not isinstance(text, Mapping):
        raise ConfigError(f"{what} has text_config={text!r}; expected a JSON object")
    return text
