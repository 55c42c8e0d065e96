"""Four gloo processes on the CPU against the single-process reference.

One world of 4 spawned processes (tests/distributed/world_worker.py) runs
every scenario once; here, in the test process:

- AllGatherExchange, tp = 1, 2, 3, 4 (two replicas at tp = 2), both collectives,
  T = 7, 1, 0, the tiny preset (C = 12) and C = 10 (padded column blocks at
  tp = 3, 4): every rank's rows equal the unsharded reference bit for bit;
  a tp leaving a rank without a column is refused with the reason;
- AllToAllExchange over worlds of 4 and 3, a different T per rank (0 too,
  and a step where every rank has none): bit for bit the reference;
- SharedHostTable: a table all four processes ask for is loaded once
  (counted across processes in a file), every process maps the same file
  (its rows' address lies in a mapping of that file: no private copy) and
  reads the same bytes; under TP = 2 x DP = 2 each shard is loaded once and
  the lookup over the shared mappings equals the reference.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.distributed import world_worker
from tests.distributed.common import (
    CONFIGS,
    TINY,
    assert_same_bits,
    layer_table,
    random_row_ids,
    reference_rows,
    sha256_of,
)
from tests.spawn import spawn_world

from engramrt.layout import EngramLayout

DEADLINE_S = 75.0  # the whole world, start-up included (about 15 s on 2 cores)
WORLD = world_worker.WORLD


def run_world(out_dir: Path) -> dict[int, dict[str, Any]]:
    """Spawn the world, wait (bounded), fail with the workers' tracebacks; each rank's results."""
    spawn_world(world_worker.run, WORLD, out_dir, deadline_s=DEADLINE_S, label="gloo")
    return {rank: torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)}


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="module")
def results(world_dir: Path) -> dict[int, dict[str, Any]]:
    return run_world(world_dir)


@pytest.mark.parametrize("num_tokens", world_worker.TP_TOKEN_COUNTS)
@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("tp", world_worker.TPS)
@pytest.mark.parametrize("config_name", world_worker.TP_CONFIGS)
def test_tp_lookup_equals_the_reference(
    results, config_name: str, tp: int, collective: str, num_tokens: int
) -> None:
    config = CONFIGS[config_name]
    key = f"tp/{config_name}/{tp}/{collective}/T{num_tokens}"
    checked = 0
    for rank in range(WORLD):
        found = world_worker.tp_groups_of(rank, tp)
        if found is None:
            assert key not in results[rank]
            continue
        replica, _members = found
        got = results[rank][key]
        seed = world_worker.tp_seed(config_name, tp, replica, num_tokens)
        assert torch.equal(got["row_ids"], random_row_ids(config, num_tokens, seed))
        assert_same_bits(
            got["rows"], reference_rows(config, got["row_ids"]), label=f"{key} rank {rank}"
        )
        checked += 1
    assert checked == (3 if tp == 3 else WORLD)


def test_tp_lookup_rows_are_random_not_zeros(results) -> None:
    """Negative control: the compared rows carry information (a lookup of zeros would fail)."""
    rows = results[0]["tp/tiny/4/all_gather/T7"]["rows"]
    assert rows.abs().amax() > 0
    assert (rows != 0).float().mean() > 0.5


def test_tp_refuses_a_rank_without_columns(results) -> None:
    for rank in range(WORLD):
        message = results[rank].get("refused/c6/4")
        assert message is not None, f"rank {rank} accepted tp=4 for C=6"
        assert "tp=4 leaves rank(s) [3] without a hash column" in message


@pytest.mark.parametrize("step", range(len(world_worker.A2A_STEPS)))
@pytest.mark.parametrize("a2a_world", world_worker.A2A_WORLDS)
@pytest.mark.parametrize("config_name", world_worker.TP_CONFIGS)
def test_all_to_all_lookup_equals_the_reference(
    results, config_name: str, a2a_world: int, step: int
) -> None:
    config = CONFIGS[config_name]
    key = f"a2a/{config_name}/{a2a_world}/step{step}"
    for rank in range(a2a_world):
        got = results[rank][key]
        assert got["row_ids"].shape[0] == world_worker.A2A_STEPS[step][rank]
        assert_same_bits(
            got["rows"], reference_rows(config, got["row_ids"]), label=f"{key} rank {rank}"
        )


def test_shared_table_is_loaded_once_and_mapped_by_everyone(results, world_dir: Path) -> None:
    loads = Counter(line.split()[0] for line in (world_dir / "loads.txt").read_text().splitlines())
    assert loads[world_worker.FULL_TABLE] == 1, loads
    expected = sha256_of(layer_table(TINY, 1))
    infos = [results[rank]["shared/full"] for rank in range(WORLD)]
    assert sum(info["created"] for info in infos) == 1
    for rank, info in enumerate(infos):
        assert info["shared"], f"rank {rank} fell back to a private copy"
        # its rows lie in a read-only shared mapping of the file: no private copy
        assert info["mapping"] == "r--s", f"rank {rank}: mapping {info['mapping']!r}"
        assert info["sha256"] == expected, f"rank {rank} reads other bytes"
    shm = world_dir / "shm"
    assert (shm / world_worker.FULL_TABLE).is_file()
    assert not list(shm.glob("*.tmp-*"))


def test_tp2_dp2_shards_are_shared_between_replicas(results, world_dir: Path) -> None:
    loads = Counter(line.split()[0] for line in (world_dir / "loads.txt").read_text().splitlines())
    layout = EngramLayout(TINY)
    table = layer_table(TINY, 0)
    for tp_rank in range(2):
        name = world_worker.shard_table_name(tp_rank)
        assert loads[name] == 1, loads
        shard = layout.column_shard(0, 2, tp_rank)
        expected = sha256_of(table[shard.row_begin : shard.row_end])
        holders = [r for r in range(WORLD) if results[r]["shared/tp2"]["name"] == name]
        assert holders == [tp_rank, tp_rank + 2]  # one rank of each replica
        assert sum(results[r]["shared/tp2"]["created"] for r in holders) == 1
        for r in holders:
            info = results[r]["shared/tp2"]
            assert info["shared"] and info["mapping"] == "r--s" and info["sha256"] == expected
    for rank in range(WORLD):
        info = results[rank]["shared/tp2"]
        assert_same_bits(
            info["rows"], reference_rows(TINY, info["row_ids"]), label=f"shared tp2 rank {rank}"
        )
