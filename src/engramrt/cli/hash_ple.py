"""``engramrt hash`` for a Qwen4-Exp config: PLE row ids of one request, streamed in chunks.

Each chunk is one engine step of one request through :class:`PleHasher` (one launch for
every PLE layer), carrying the request's last ``N - 1`` raw ids from step to step as an
engine does (docs/families.md §4); the result is checked against the numpy reference
hashing the whole request at once (:func:`ple_row_ids`).
"""

from __future__ import annotations

import json
from typing import Any

from engramrt.cli._hash_run import HashRun, print_match, save_row_ids
from engramrt.errors import ValidationError

__all__ = ["check_ple_token_ids", "hash_ple", "stream_ple"]


def check_ple_token_ids(option: str, token_ids: Any, config: Any) -> None:
    """Refuse an id outside ``[0, vocab_size)`` that is not the EOS id (what the model's
    ``embed_tokens`` can hold), naming the option, the position and the value."""
    import numpy as np

    bad = ((token_ids < 0) | (token_ids >= config.vocab_size)) & (token_ids != config.eos)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValidationError(
            f"{option} holds {int(token_ids[index])} at position {index}; expected token ids "
            f"in [0, vocab_size={config.vocab_size}) or the EOS id {config.eos}"
        )


def stream_ple(hasher: Any, token_ids: Any, chunks: list[int] | None) -> Any:
    """Row ids ``[T, L, C]`` int64 (numpy) of one request's ``token_ids`` hashed chunk by
    chunk, each chunk a step whose context is the one the step before returned."""
    import numpy as np
    import torch

    from engramrt.hashing.stream import split_chunks

    device = hasher.device
    context = hasher.start_contexts(1)  # [1, N - 1], all EOS: the request starts here
    results = []
    start = 0
    for size in split_chunks(int(token_ids.shape[0]), chunks):
        chunk = torch.as_tensor(token_ids[start : start + size], dtype=torch.int64, device=device)
        query_start_loc = torch.tensor([0, size], dtype=torch.int64, device=device)
        rows, context = hasher(chunk, query_start_loc, context)
        results.append(rows.to(torch.int64).cpu().numpy())
        start += size
    if not results:
        return np.zeros((0, hasher.n_layers, hasher.n_cols), dtype=np.int64)
    return np.concatenate(results)


def hash_ple(run: HashRun, config: Any) -> bool:
    """Hash the run's token ids under the PLE ``config`` (PLE on), print or save the ids;
    returns whether streaming matched one-shot hashing."""
    import numpy as np

    from engramrt.families.qwen4_ple.ids import ple_row_ids
    from engramrt.families.qwen4_ple.ops import PleHasher

    if run.history is not None:
        raise ValidationError(
            f"--history={run.history!r} is for deepseek-engram configs; a qwen4-ple request "
            f"carries its last N - 1 = {config.context_len} ids between chunks (leave "
            f"--history out)"
        )
    if run.text is not None and run.tokenizer is None:
        raise ValidationError(
            f"--text with the qwen4-ple config {run.config!r} needs --tokenizer (the default "
            f"is DeepSeek-V4's tokenizer); or give --ids / --ids-file"
        )
    token_ids = run.token_ids()
    check_ple_token_ids(run.ids_option, token_ids, config)
    hasher = PleHasher(config, run.device, backend=run.backend)  # ids checked above
    row_ids = stream_ple(hasher, token_ids, run.chunk_sizes)
    matches = bool(np.array_equal(row_ids, ple_row_ids(token_ids, hasher.consts, config.eos)))
    if run.out is not None:
        save_row_ids(run.out, row_ids)
    if run.as_json:
        report = {
            "family": "qwen4-ple",
            "config": run.config,
            "token_ids": token_ids.tolist(),
            "ple_layer_ids": list(config.ple_layer_ids),
            "eos_token_id": config.eos,
            "chunks": run.chunk_sizes,
            "row_ids": row_ids.tolist(),
            "matches_one_shot": matches,
            "backend": hasher.backend,
        }
        print(json.dumps(report))
    else:
        _print_rows(token_ids, run, config, row_ids, matches, hasher.backend)
    return matches


def _print_rows(
    token_ids: Any, run: HashRun, config: Any, row_ids: Any, matches: bool, backend: str
) -> None:
    from rich.table import Table

    from engramrt.cli._console import console

    orders = range(2, config.ngram_size + 1)
    heads = config.heads_per_ngram
    table = Table(title=f"PLE row ids, layer {config.ple_layer_ids[0]} (head 0 of each order)")
    for name in ("pos", "token", *(f"{n}-gram" for n in orders)):
        table.add_column(name, justify="right")
    for p in range(min(16, token_ids.shape[0])):
        cells = (f"{row_ids[p, 0, (n - 2) * heads]:,}" for n in orders)
        table.add_row(str(p), str(token_ids[p]), *cells)
    console.print(table)
    print_match(
        run,
        f"{token_ids.shape[0]} tokens, {config.n_layers} PLE layer(s) "
        f"{list(config.ple_layer_ids)}, chunks {run.chunk_sizes or 'all at once'}, backend "
        f"{backend}",
        row_ids,
        matches,
    )
