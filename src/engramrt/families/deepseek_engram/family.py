"""DeepSeek Engram as a :class:`~engramrt.family.MemoryFamily` value.

A view over the classes that compute it (:class:`~engramrt.config.EngramConfig`,
:class:`~engramrt.layout.EngramLayout`, :mod:`engramrt.checkpoint.names`): what tables
the model has, what checkpoint tensors it reads and what decides its rows, for the parts
of the runtime that serve any family.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from engramrt.checkpoint.names import DEFAULT_HEAD_NAMES, DEFAULT_SCALE_NAME, DEFAULT_WEIGHT_NAME
from engramrt.config import PRESETS, EngramConfig
from engramrt.errors import ValidationError
from engramrt.family import FP8_UE8M0, TableSpec, TensorRole, layer_tables
from engramrt.layout import EngramLayout

if TYPE_CHECKING:
    from engramrt.tokenmap import TokenMap

__all__ = ["DeepSeekEngramFamily"]


class DeepSeekEngramFamily:
    """DeepSeek's Engram (V4.1-Flash and the configs like it).

    Args:
        config: an :class:`EngramConfig` or a preset's name (``"dsv41-flash"``, ``"tiny"``).
        token_map: the compressed token map the ids go through; its digest enters
            :meth:`fingerprint` (None: the fingerprint covers the hash alone).

    Attributes:
        config, layout: the config and its hash layout.
    """

    name = "deepseek-engram"

    def __init__(self, config: EngramConfig | str, token_map: TokenMap | None = None) -> None:
        if isinstance(config, str):
            if config not in PRESETS:
                raise ValidationError(f"config={config!r}; expected one of {sorted(PRESETS)}")
            config = PRESETS[config]
        if not isinstance(config, EngramConfig):
            raise ValidationError(
                f"config is a {type(config).__name__}; expected an EngramConfig or a preset name"
            )
        self.config = config
        self.layout = EngramLayout(config)
        self.token_map = token_map
        self.layer_ids: tuple[int, ...] = tuple(config.layer_ids)
        self.history_window = config.max_ngram_size - 1

    def tables(self) -> list[TableSpec]:
        """One fp8 table per Engram layer: ``engram_num_embeddings`` rows of ``E`` values and
        ``E/32`` scale bytes, split by tensor parallelism along hash columns."""
        return layer_tables(
            self.layer_ids,
            self.config.num_embeddings,
            self.config.head_dim,
            FP8_UE8M0,
            self.layout.offsets,
            self.layout.col_primes,
            "columns",
        )

    def tensor_roles(self) -> list[TensorRole]:
        """Each layer's table (fp8 values and ue8m0 scale bytes) and its head's weights
        (``wkv`` bf16, or fp8 with float32 block scales of 128 x 128), under the names
        DeepSeek-V4.1 checkpoints use (the first of each role's names)."""
        cfg = self.config
        e, hidden, hc, cols = cfg.head_dim, cfg.hidden_size, cfg.hc_mult, cfg.n_cols
        wkv = ((hc + 1) * hidden, cols * e)
        roles = []
        for index, layer in enumerate(self.layer_ids):
            rows = cfg.num_embeddings[index]
            spec = (
                ("table", DEFAULT_WEIGHT_NAME, ("float8_e4m3fn",), (rows, e), False),
                ("scale", DEFAULT_SCALE_NAME, ("float8_e8m0fnu", "uint8"), (rows, e // 32), False),
                ("wkv", DEFAULT_HEAD_NAMES["wkv"][0], ("bfloat16", "float8_e4m3fn"), wkv, False),
                ("wkv_scale", DEFAULT_HEAD_NAMES["wkv_scale"][0], ("float32",),
                 (-(-wkv[0] // 128), -(-wkv[1] // 128)), True),
                ("q_weight", DEFAULT_HEAD_NAMES["q_weight"][0], ("bfloat16", "float16", "float32"),
                 (hc, hidden), False),
                ("k_weight", DEFAULT_HEAD_NAMES["k_weight"][0], ("bfloat16", "float16", "float32"),
                 (hc, hidden), False),
            )  # fmt: skip
            for role, template, dtypes, shape, optional in spec:
                name = template.format(layer=layer, index=index)
                roles.append(TensorRole(role, name, dtypes, shape, layer, optional))
        return roles

    def fingerprint(self) -> str:
        """SHA-256 of the hash layout (seed, multipliers, primes, offsets) and, with a token
        map, of the map and the pad id it gives."""
        record: dict[str, object] = {"family": self.name, **self.layout.to_dict()}
        if self.token_map is not None:
            record["token_map_sha256"] = self.token_map.map_sha256
            record["pad_id"] = self.token_map.pad_id(self.config)
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
