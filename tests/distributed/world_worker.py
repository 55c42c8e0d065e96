"""One rank of the 4-process gloo world of tests/distributed/test_world.py.

Started with the ``spawn`` method, one process per rank. Every scenario
runs here once and each rank saves what it saw and produced to
``out_dir/rank<r>.pt``; the test process checks it against the
single-process reference. A failure is written to ``error-<rank>.txt`` and
ends the process with exit code 1.

Groups (every rank creates every group, in the same order):
- tp = 1: one group per rank; tp = 2: ``[0, 1]`` and ``[2, 3]`` (two
  data-parallel replicas); tp = 3: ``[0, 1, 2]`` (rank 3 idles); tp = 4: all.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from typing import Any

TIMEOUT_S = 30.0
TP_CONFIGS = ("tiny", "c10")
TPS = (1, 2, 3, 4)
TP_TOKEN_COUNTS = (7, 1, 0)
A2A_WORLDS = (4, 3)
A2A_STEPS = ((5, 0, 3, 8), (0, 0, 0, 0), (1, 2, 1, 2))  # T of ranks 0..3 per step
LOADER_SLEEP_S = 0.3  # the creator loads slowly, so the others really wait
FULL_TABLE = "tiny-layer1-full"
WORLD = 4


def tp_groups_of(rank: int, tp: int) -> tuple[int, list[int]] | None:
    """``(replica index, members)`` of the tp group ``rank`` belongs to, None when idle."""
    if tp == 3:
        return (0, [0, 1, 2]) if rank < 3 else None
    replica = rank // tp
    return replica, list(range(replica * tp, (replica + 1) * tp))


def tp_seed(config_name: str, tp: int, replica: int, num_tokens: int) -> int:
    return 100_000 * TP_CONFIGS.index(config_name) + 1000 * tp + 100 * replica + num_tokens


def a2a_seed(config_name: str, world: int, step: int, rank: int) -> int:
    return 7_000_000 + 100_000 * TP_CONFIGS.index(config_name) + 1000 * world + 10 * step + rank


def shard_table_name(tp_rank: int) -> str:
    return f"tiny-layer0-rank{tp_rank}-of-2"


def mapping_permissions(path: Path | None, pointer: int) -> str:
    """The permissions (``r--s``: read-only, shared) of this process's mapping of file
    ``path`` that holds ``pointer``; ``""`` when no mapping of that file does (a copy)."""
    if path is None:
        return ""
    target = str(path.resolve())
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= pointer < end:
                    return fields[1]
    return ""


def counting_loader(out_dir: Path, name: str, table: Any) -> Any:
    """A loader that records each call (one line per call, O_APPEND) and fills ``table``."""

    def load(target: Any) -> None:
        fd = os.open(out_dir / "loads.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{name} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        time.sleep(LOADER_SLEEP_S)
        target.copy_(table)

    return load


def run(rank: int, world_size: int, init_file: str, out_dir_name: str) -> None:
    import torch

    torch.set_num_threads(1)  # world_size processes share the machine's cores
    out_dir = Path(out_dir_name)
    try:
        import torch.distributed as dist
        from tests.distributed.common import (
            CONFIGS,
            TINY,
            layer_table,
            random_row_ids,
            sha256_of,
            shard_store,
        )

        from engramrt.distributed import SharedHostTable, shared_store
        from engramrt.errors import ShardingError
        from engramrt.exchange import AllGatherExchange, AllToAllExchange
        from engramrt.layout import EngramLayout
        from engramrt.lookup import row_bytes_for
        from engramrt.lookup.tiers import HostOptions, TablePlacement

        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        world = dist.group.WORLD
        groups: dict[tuple[int, ...], Any] = {}
        for members in ([0], [1], [2], [3], [0, 1], [2, 3], [0, 1, 2]):
            groups[tuple(members)] = dist.new_group(members)  # every rank calls each
        groups[(0, 1, 2, 3)] = world
        saved: dict[str, Any] = {}

        # -- tensor parallel: every tp, both collectives, against each config --
        for config_name in TP_CONFIGS:
            config = CONFIGS[config_name]
            for tp in TPS:
                found = tp_groups_of(rank, tp)
                if found is None:
                    continue
                replica, members = found
                tp_rank = members.index(rank)
                store = shard_store(config, tp, tp_rank)
                for collective in ("all_gather", "all_reduce"):
                    lookup = AllGatherExchange(
                        store,
                        num_cols=config.n_cols,
                        group=groups[tuple(members)],
                        collective=collective,
                    )
                    for num_tokens in TP_TOKEN_COUNTS:
                        row_ids = random_row_ids(
                            config, num_tokens, tp_seed(config_name, tp, replica, num_tokens)
                        )
                        out = None
                        if num_tokens == 7:  # once with a caller's (poisoned) output buffer
                            out = torch.full(
                                (num_tokens, config.n_cols, config.head_dim),
                                float("nan"),
                                dtype=torch.bfloat16,
                            )
                        rows = lookup.fetch(row_ids, out=out)
                        assert out is None or rows.data_ptr() == out.data_ptr()
                        key = f"tp/{config_name}/{tp}/{collective}/T{num_tokens}"
                        saved[key] = {"row_ids": row_ids, "rows": rows.clone()}
        # a tp that leaves a rank without a column is refused on every rank
        try:
            AllGatherExchange(
                shard_store(CONFIGS["c6"], 3, 0), num_cols=CONFIGS["c6"].n_cols, group=world
            )
        except ShardingError as exc:
            saved["refused/c6/4"] = str(exc)

        # -- all-to-all over the whole world (and a world of 3) --
        for config_name in TP_CONFIGS:
            config = CONFIGS[config_name]
            for a2a_world in A2A_WORLDS:
                if rank >= a2a_world:
                    continue
                group = groups[tuple(range(a2a_world))]
                lookup_a2a = AllToAllExchange(
                    shard_store(config, a2a_world, rank), num_cols=config.n_cols, group=group
                )
                for step, token_counts in enumerate(A2A_STEPS):
                    row_ids = random_row_ids(
                        config, token_counts[rank], a2a_seed(config_name, a2a_world, step, rank)
                    )
                    rows = lookup_a2a.fetch(row_ids)
                    key = f"a2a/{config_name}/{a2a_world}/step{step}"
                    saved[key] = {"row_ids": row_ids, "rows": rows}

        # -- one host copy per node: a whole table every rank maps --
        shm = out_dir / "shm"
        full = layer_table(TINY, 1)
        table = SharedHostTable.create_or_attach(
            FULL_TABLE,
            full.shape[0],
            full.shape[1],
            counting_loader(out_dir, FULL_TABLE, full),
            directory=shm,
            group=world,
            fingerprint="tiny layer 1, seed 11",
            timeout_s=TIMEOUT_S,
        )
        saved["shared/full"] = {
            "created": table.created,
            "shared": table.shared,
            "sha256": sha256_of(table.rows),
            "mapping": mapping_permissions(table.path, table.rows.data_ptr()),
        }

        # -- TP = 2 x DP = 2: each shard loaded once, mapped by both replicas --
        layout = EngramLayout(TINY)
        replica, members = tp_groups_of(rank, 2) or (0, [])
        tp_rank = members.index(rank)
        shard = layout.column_shard(0, 2, tp_rank)
        shard_rows = layer_table(TINY, 0)[shard.row_begin : shard.row_end].clone()
        name = shard_table_name(tp_rank)
        table = SharedHostTable.create_or_attach(
            name,
            shard.num_rows,
            row_bytes_for(TINY.head_dim),
            counting_loader(out_dir, name, shard_rows),
            directory=shm,
            group=world,  # every rank calls now, each for its shard: one node, room for both
            fingerprint=f"tiny layer 0, rank {tp_rank} of 2, seed 11",
            timeout_s=TIMEOUT_S,
        )
        placement = TablePlacement(HostOptions(backend="reference"), "cpu", 2, tp_rank)
        store = shared_store(table, placement, shard=shard)
        row_ids = random_row_ids(TINY, 9, tp_seed("tiny", 2, replica, 9) + 50)
        exchange = AllGatherExchange(store, num_cols=TINY.n_cols, group=groups[tuple(members)])
        rows = exchange.fetch(row_ids)
        saved["shared/tp2"] = {
            "name": name,
            "created": table.created,
            "shared": table.shared,
            "sha256": sha256_of(table.rows),
            "mapping": mapping_permissions(table.path, table.rows.data_ptr()),
            "row_ids": row_ids,
            "rows": rows,
        }

        torch.save(saved, out_dir / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
