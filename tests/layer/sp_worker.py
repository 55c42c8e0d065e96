"""A sequence-parallel worker process for tests/layer/test_parallel.py.

Started with the ``spawn`` method, one process per rank of a world of
``world_size`` processes: gloo over CPU tensors (the kernels in Triton's
interpreter), or NCCL with one GPU per rank. For tp = 2, 3, 4 (sub-groups
of the world, those that fit),
both collectives and a few batch sizes, each member rank builds its column
shard of the same seeded table, an :class:`EngramLayer` over the group,
runs one step on its token share and saves what it saw and produced to
``out_dir`` for the test process to check. A failure is written to
``error-<rank>.txt`` and ends the process with exit code 1.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

TPS = (2, 3, 4)
TOKEN_COUNTS = (7, 2, 0)  # T = 7: every rank has tokens, the last padded; T = 2 < tp: some none
MAX_TOKENS = 8
TIMEOUT_S = 30.0


def result_path(out_dir: Path, tp: int, collective: str, num_tokens: int, rank: int) -> Path:
    return out_dir / f"tp{tp}-{collective}-T{num_tokens}-rank{rank}.pt"


def scenario_seed(tp: int, num_tokens: int) -> int:
    return 1000 * tp + num_tokens


def run(rank: int, world_size: int, init_file: str, out_dir: str, backend: str = "gloo") -> None:
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # world_size processes share the machine's cores
    try:
        from tests.layer.common import (
            CONFIG,
            layer_table,
            random_hidden,
            random_row_ids,
            random_weights,
            shard_store,
        )

        from engramrt._backend import interpreter_enabled
        from engramrt.exchange import (
            SEQUENCE_PARALLEL_COLLECTIVES,
            SequenceParallelExchange,
            tokens_per_rank,
        )
        from engramrt.layer import EngramLayer

        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        truncating_store = device.type == "cpu" and interpreter_enabled()
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        tps = [tp for tp in TPS if tp <= world_size]
        groups = {tp: dist.new_group(list(range(tp))) for tp in tps}  # every rank calls each
        table = layer_table()
        for tp in tps:
            if rank >= tp:
                continue
            store = shard_store(table, tp, rank, device=device)
            for collective in SEQUENCE_PARALLEL_COLLECTIVES:
                exchange = SequenceParallelExchange(
                    store,
                    num_cols=CONFIG.n_cols,
                    max_tokens=MAX_TOKENS,
                    group=groups[tp],
                    collective=collective,
                )
                layer = EngramLayer(CONFIG, exchange, max_tokens=MAX_TOKENS)
                for step, num_tokens in enumerate(TOKEN_COUNTS):
                    seed = scenario_seed(tp, num_tokens)
                    layer.load_weights(**random_weights(seed, fp8=tp == 3))
                    # all T tokens, the same on every rank
                    row_ids = random_row_ids(num_tokens, seed).to(device)
                    part = tokens_per_rank(num_tokens, tp)
                    hidden_all = random_hidden(tp * part, seed)  # padding tokens random too
                    hidden = hidden_all[rank * part : (rank + 1) * part].contiguous().to(device)
                    if step % 2 == 0:
                        layer.prepare(row_ids)
                        out, kv = layer(hidden, return_kv=True)
                    else:
                        out, kv = layer(hidden, row_ids, return_kv=True)
                    torch.save(
                        {
                            "rows": layer.staged_rows[:part].cpu(),
                            "kv": kv.cpu(),
                            "out": out.cpu(),
                            "hidden": hidden.cpu(),
                            "q_weight": layer.head.q_weight.detach().cpu(),
                            "k_weight": layer.head.k_weight.detach().cpu(),
                            "weight_rounding": layer.head.wkv.weight_rounding,
                            "truncating_store": truncating_store,
                        },
                        result_path(Path(out_dir), tp, collective, num_tokens, rank),
                    )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
