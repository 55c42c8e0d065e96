"""A token-keyed memory family: one bf16 table per layer, row id of head ``c`` =
``offset_c + (token * multiplier_l) mod prime_c``; no n-grams, no history."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from engramrt.family import BF16, TableSpec, TensorRole, layer_tables


class ToyFamily:
    name = "toy-keyed"
    history_window = 0

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.layer_ids = tuple(config["toy_layer_ids"])
        self.primes = np.array(config["toy_primes"], dtype=np.int64)  # [C]
        self.offsets = np.concatenate([[0], np.cumsum(self.primes)[:-1]]).astype(np.int64)
        self.width = int(config["toy_width"])

    def row_ids(self, token_ids: np.ndarray) -> np.ndarray:
        """``[T, L, C]`` int64."""
        mult = np.array([2 * layer + 1 for layer in self.layer_ids], dtype=np.int64)
        keyed = token_ids[:, None, None] * mult[None, :, None]
        return keyed % self.primes[None, None, :] + self.offsets[None, None, :]

    def tables(self) -> list[TableSpec]:
        rows = int(self.primes.sum())
        n = len(self.layer_ids)
        return layer_tables(
            self.layer_ids,
            [rows] * n,
            self.width,
            BF16,
            np.tile(self.offsets, (n, 1)),
            np.tile(self.primes, (n, 1)),
            "width",
        )

    def tensor_roles(self) -> list[TensorRole]:
        rows = int(self.primes.sum())
        return [
            TensorRole(
                "table", f"layers.{layer}.toy.table", ("bfloat16",), (rows, self.width), layer
            )
            for layer in self.layer_ids
        ]

    def fingerprint(self) -> str:
        record = {"primes": self.primes.tolist(), "layers": list(self.layer_ids)}
        return hashlib.sha256(json.dumps(record).encode()).hexdigest()
