"""Qwen4-Exp PLE as a :class:`~engramrt.family.MemoryFamily` value: its bf16 tables, the
checkpoint tensors of its layers and the fingerprint of its hashing."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.config import PleConfig, resolve_ple_config
from engramrt.families.qwen4_ple.ids import PleConstants
from engramrt.family import BF16, TableSpec, TensorRole, layer_tables

__all__ = ["PREFIXES", "Qwen4PleFamily"]

PREFIXES = ("model.language_model.", "model.")
"""Where a checkpoint puts ``layers.<i>.ple.``: a composite ``qwen4_exp`` checkpoint, then a
text-only one."""

MODEL_DTYPES = ("bfloat16", "float16", "float32")


class Qwen4PleFamily:
    """Qwen4-Exp per-layer n-gram embeddings.

    Args:
        config: a :class:`PleConfig`, an HF ``config.json`` object, or a path to one (file
            or model directory); PLE must be on (``ple_layer_ids`` not empty).
        prefix: the checkpoint names' prefix (:data:`PREFIXES`).

    Attributes:
        config, constants: the config and its hash constants.
    """

    name = "qwen4-ple"

    def __init__(
        self, config: PleConfig | Mapping[str, Any] | str | Path, *, prefix: str = PREFIXES[0]
    ) -> None:
        config = resolve_ple_config(config)
        if prefix not in PREFIXES:
            raise ValidationError(f"prefix={prefix!r}; expected one of {PREFIXES}")
        self.config = config
        self.prefix = prefix
        self.constants = PleConstants.from_config(config)
        self.layer_ids: tuple[int, ...] = tuple(config.ple_layer_ids)
        self.history_window = config.context_len

    def tables(self) -> list[TableSpec]:
        """One bf16 table per PLE layer: ``R`` rows (padded) of ``d = E / C`` values, split by
        tensor parallelism along each row's values (``embedding_colwise``)."""
        consts = self.constants
        return layer_tables(
            self.layer_ids,
            consts.table_rows,
            self.config.table_width,
            BF16,
            consts.offsets,
            consts.head_sizes,
            "width",
        )

    def tensor_roles(self) -> list[TensorRole]:
        """Each PLE layer's table (the runtime parameter; checkpoints store it as
        ``split_ngram_parts`` row shards ``...ngram_embedding.shard_<k>.weight``), its hash
        buffers (optional: computed from the config when absent) and its layer weights."""
        cfg = self.config
        hd, e, k = cfg.hc_count * cfg.hidden_size, cfg.embed_dim, cfg.ple_conv_kernel_size
        roles = []
        for index, layer in enumerate(self.layer_ids):
            base = f"{self.prefix}layers.{layer - 1}.ple."
            emb = f"{base}ple_embedding."
            spec = (
                ("table", f"{emb}ngram_embedding.weight", MODEL_DTYPES,
                 (self.constants.table_rows[index], cfg.table_width), False),
                ("layer_multipliers", f"{emb}layer_multipliers", ("int64",),
                 (cfg.ngram_size,), True),
                ("ngram_heads_vocab_sizes", f"{emb}ngram_heads_vocab_sizes", ("int64",),
                 (cfg.n_cols,), True),
                ("ngram_heads_offsets", f"{emb}ngram_heads_offsets", ("int64",), (cfg.n_cols,),
                 True),
                ("key_proj", f"{base}key_proj.weight", MODEL_DTYPES, (hd, e), False),
                ("value_proj", f"{base}value_proj.weight", MODEL_DTYPES, (cfg.hidden_size, e),
                 False),
                ("norm_key", f"{base}norm_key.weight", MODEL_DTYPES, (hd,), False),
                ("norm_query", f"{base}norm_query.weight", MODEL_DTYPES, (hd,), False),
                ("norm_conv", f"{base}norm_conv.weight", MODEL_DTYPES, (hd,), False),
                ("conv1d", f"{base}conv1d.weight", MODEL_DTYPES, (hd, 1, k), False),
            )  # fmt: skip
            for role, name, dtypes, shape, optional in spec:
                roles.append(TensorRole(role, name, dtypes, shape, layer, optional))
        return roles

    def fingerprint(self) -> str:
        """SHA-256 of what decides a token's rows: the constants, the EOS id, N and H."""
        consts = self.constants
        record = {
            "family": self.name,
            "layer_ids": list(self.layer_ids),
            "eos": self.config.eos,
            "ngram_size": self.config.ngram_size,
            "heads_per_ngram": self.config.heads_per_ngram,
            "multipliers": consts.multipliers.tolist(),
            "head_sizes": consts.head_sizes.tolist(),
            "offsets": consts.offsets.tolist(),
            "table_rows": list(consts.table_rows),
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
