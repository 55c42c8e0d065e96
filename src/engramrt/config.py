"""Engram configuration: the fields of an HF ``config.json`` that Engram reads.

A config says *what* the model computes (layers, n-gram orders, heads,
table sizes, the compressed vocabulary). Everything derived from it — the
hash multipliers, primes and column offsets — lives in
:class:`engramrt.layout.EngramLayout`.

Configs come from a preset name (``dsv41-flash``, ``tiny``), an HF
``config.json`` file, or a model directory holding one. Fields the backbone
uses but Engram does not are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engramrt._io import read_json
from engramrt.errors import ConfigError

__all__ = ["PRESETS", "EngramConfig", "load_config"]


_INT64_MAX = 2**63 - 1


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    if value <= 0:
        raise ConfigError(f"{name}={value} must be a positive integer (> 0)")
    if value > _INT64_MAX:
        raise ConfigError(f"{name}={value} does not fit int64; expected at most {_INT64_MAX}")
    return value


def _int_tuple(name: str, value: Any, length: int) -> tuple[int, ...]:
    """An int broadcast to ``length`` values, or a sequence of exactly ``length`` ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        values: list[Any] = [value] * length
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) != length:
            raise ConfigError(f"{name}={value!r} has {len(values)} values; expected {length}")
    else:
        raise ConfigError(f"{name}={value!r} must be an int or a list of {length} ints")
    return tuple(_positive_int(f"{name}[{i}]", v) for i, v in enumerate(values))


@dataclass(frozen=True)
class EngramConfig:
    """The Engram fields of a model config (SPEC §1).

    Attributes:
        layer_ids: backbone block indices that hold an Engram layer.
        vocab_size: per n-gram order 2..N, the base bucket count of each
            head (``engram_vocab_size``; an int in the HF file means the same
            value for every order).
        num_embeddings: table rows per Engram layer (``engram_num_embeddings``).
        max_ngram_size: N, the longest n-gram.
        n_heads: hash heads per n-gram order.
        head_dim: E, fp8 values per table row.
        compressed_vocab_size: size of the compressed token map.
        pad_token_id: tokenizer id whose compressed id pads n-grams.
        hidden_size: D of the backbone.
        hc_mult: number of hyper-connection streams.
        rms_norm_eps: epsilon of the gate's RMS norms.
        hash_seed: seed of the hash multipliers (0 in DeepSeek's code).
    """

    layer_ids: tuple[int, ...]
    vocab_size: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    pad_token_id: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float = 1e-6
    hash_seed: int = 0
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        n = _positive_int("engram_max_ngram_size", self.max_ngram_size)
        if n < 2:
            raise ConfigError(f"engram_max_ngram_size={n} must be at least 2 (bigrams)")
        if not self.layer_ids:
            raise ConfigError("engram_layer_ids=[] must name at least one layer")
        ids = list(self.layer_ids)
        for i, layer in enumerate(ids):
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ConfigError(f"engram_layer_ids[{i}]={layer!r} must be a non-negative integer")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"engram_layer_ids={ids} has repeated layers")
        object.__setattr__(self, "layer_ids", tuple(ids))
        object.__setattr__(
            self, "vocab_size", _int_tuple("engram_vocab_size", self.vocab_size, n - 1)
        )
        object.__setattr__(
            self,
            "num_embeddings",
            _int_tuple("engram_num_embeddings", self.num_embeddings, len(ids)),
        )
        for i, v in enumerate(self.vocab_size):
            if v < 2:
                raise ConfigError(f"engram_vocab_size[{i}]={v} must be at least 2")
        _positive_int("engram_n_heads", self.n_heads)
        head_dim = _positive_int("engram_head_dim", self.head_dim)
        if head_dim % 32:
            raise ConfigError(
                f"engram_head_dim={head_dim} must be a multiple of 32 (one ue8m0 scale per 32 values)"
            )
        _positive_int("engram_compressed_vocab_size", self.compressed_vocab_size)
        if (
            isinstance(self.pad_token_id, bool)
            or not isinstance(self.pad_token_id, int)
            or self.pad_token_id < 0
        ):
            raise ConfigError(
                f"engram_pad_token_id={self.pad_token_id!r} must be a non-negative integer"
            )
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("hc_mult", self.hc_mult)
        eps = self.rms_norm_eps
        if (
            isinstance(eps, bool)
            or not isinstance(eps, (int, float))
            or not eps > 0
            or not math.isfinite(eps)
        ):
            raise ConfigError(f"rms_norm_eps={eps!r} must be a finite positive number")
        if (
            isinstance(self.hash_seed, bool)
            or not isinstance(self.hash_seed, int)
            or not 0 <= self.hash_seed <= _INT64_MAX
        ):
            raise ConfigError(
                f"hash_seed={self.hash_seed!r} must be an integer in [0, 2**63) (it seeds "
                f"numpy.random.default_rng, which refuses negative seeds)"
            )

    # Derived sizes ---------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        """C = (N - 1) * H hash columns per layer."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def row_bytes(self) -> int:
        """Bytes of one fp8 table row: E values plus E/32 ue8m0 scale bytes."""
        return self.head_dim + self.head_dim // 32

    # Conversions -----------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], *, name: str = "custom") -> EngramConfig:
        """Build from the fields of an HF ``config.json`` (extra fields are ignored)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a JSON object; got {type(data).__name__}")
        required = {
            "engram_layer_ids": "layer_ids",
            "engram_vocab_size": "vocab_size",
            "engram_num_embeddings": "num_embeddings",
            "engram_max_ngram_size": "max_ngram_size",
            "engram_n_heads": "n_heads",
            "engram_head_dim": "head_dim",
            "engram_compressed_vocab_size": "compressed_vocab_size",
            "engram_pad_token_id": "pad_token_id",
            "hidden_size": "hidden_size",
            "hc_mult": "hc_mult",
        }
        missing = [key for key in required if key not in data]
        if missing:
            raise ConfigError(f"config ({name}) lacks the field(s) {', '.join(missing)}")
        kwargs: dict[str, Any] = {attr: data[key] for key, attr in required.items()}
        if not isinstance(kwargs["layer_ids"], Sequence) or isinstance(kwargs["layer_ids"], str):
            raise ConfigError(f"engram_layer_ids={kwargs['layer_ids']!r} must be a list of ints")
        kwargs["layer_ids"] = tuple(kwargs["layer_ids"])
        if "rms_norm_eps" in data:
            kwargs["rms_norm_eps"] = data["rms_norm_eps"]
        for seed_key in ("engram_hash_seed", "engram_seed"):
            if seed_key in data:
                kwargs["hash_seed"] = data[seed_key]
        return cls(**kwargs, name=name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` fields of this config (round-trips through from_hf_dict).

        ``engram_vocab_size`` is written as one int when every n-gram order shares it,
        as SGLang and vLLM read it (both compute ``config.engram_vocab_size - 1``); a
        list only when the orders differ, which neither engine can load.
        """
        vocab_size = set(self.vocab_size)
        return {
            "engram_layer_ids": list(self.layer_ids),
            "engram_vocab_size": vocab_size.pop()
            if len(vocab_size) == 1
            else list(self.vocab_size),
            "engram_num_embeddings": list(self.num_embeddings),
            "engram_max_ngram_size": self.max_ngram_size,
            "engram_n_heads": self.n_heads,
            "engram_head_dim": self.head_dim,
            "engram_compressed_vocab_size": self.compressed_vocab_size,
            "engram_pad_token_id": self.pad_token_id,
            "engram_hash_seed": self.hash_seed,
            "hidden_size": self.hidden_size,
            "hc_mult": self.hc_mult,
            "rms_norm_eps": self.rms_norm_eps,
        }

    def replace(self, **changes: Any) -> EngramConfig:
        return dataclasses.replace(self, **changes)


# DeepSeek-V4.1-Flash (SPEC §1).
_DSV41_FLASH = EngramConfig(
    layer_ids=(1, 14),
    vocab_size=(16_000_000,) * 3,
    num_embeddings=(384_006_168, 384_016_682),
    max_ngram_size=4,
    n_heads=8,
    head_dim=256,
    compressed_vocab_size=99_092,
    pad_token_id=2,
    hidden_size=5120,
    hc_mult=4,
    rms_norm_eps=1e-6,
    name="dsv41-flash",
)

# Same tokenizer, token map and hashing structure as V4.1-Flash (N = 4, two
# layers), but 4 heads and ~4k buckets per head: ~49k rows of 66 B per layer,
# so tests and the demo run anywhere. num_embeddings is exactly the layout's sum.
_TINY = _DSV41_FLASH.replace(
    layer_ids=(1, 3),
    vocab_size=(4096, 4096, 4096),
    num_embeddings=(49_796, 50_980),
    n_heads=4,
    head_dim=64,
    hidden_size=256,
    name="tiny",
)

PRESETS: dict[str, EngramConfig] = {c.name: c for c in (_DSV41_FLASH, _TINY)}


def load_config(source: str | Path | EngramConfig | Mapping[str, Any]) -> EngramConfig:
    """A config from a preset name, a ``config.json``, a model directory or a dict."""
    if isinstance(source, EngramConfig):
        return source
    if isinstance(source, Mapping):
        return EngramConfig.from_hf_dict(source)
    text = str(source)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        if path.suffix != ".json" and "/" not in text:
            raise ConfigError(
                f"config={text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file"
            )
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = read_json(path, ConfigError, f"config file {str(path)!r}")
    return EngramConfig.from_hf_dict(data, name=str(path))
