"""The toy family's command-line hooks (what engramrt's ``hash``, ``plan`` and ``inspect``
call for its configs)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
from tests.families.toy.family import ToyFamily


def read_config(loaded: Any) -> dict[str, Any]:
    return dict(loaded.data)


def hash_run(run: Any, loaded: Any) -> bool:
    family = ToyFamily(read_config(loaded))
    token_ids = run.token_ids()
    sizes = run.chunk_sizes or [len(token_ids)]
    bounds = np.cumsum([0, *sizes])
    streamed = np.concatenate(
        [family.row_ids(token_ids[a:b]) for a, b in itertools.pairwise(bounds)]
        + [family.row_ids(token_ids[bounds[-1] :])]
    )
    matches = bool(np.array_equal(streamed, family.row_ids(token_ids)))
    print(json.dumps({"family": family.name, "row_ids": streamed.tolist(), "matches": matches}))
    return matches


def inspect_report(loaded: Any, tp: int) -> dict[str, Any]:
    family = ToyFamily(read_config(loaded))
    return {"family": family.name, "primes": family.primes.tolist(), "tp": tp}


def print_inspect(report: dict[str, Any]) -> None:
    print(f"{report['family']}: primes {report['primes']}")
