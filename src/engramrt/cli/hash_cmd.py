"""``engramrt hash``: row ids of one sequence, streamed in chunks like an engine.

The family of ``--config`` (:func:`engramrt.cli._family_config.load_family_config`, through
the family registry) picks the runner: DeepSeek Engram here, any other family its
command-line hooks' ``hash_run`` (Qwen4-Exp PLE: :mod:`engramrt.cli.family_ple`). Each takes the run's options as one :class:`HashRun`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from engramrt.cli._family_config import FamilyConfig, FamilyConfigOption
from engramrt.cli._hash_run import HashRun, print_match, save_row_ids


def _hash_engram(run: HashRun, loaded: FamilyConfig) -> bool:
    """DeepSeek Engram: compressed ids through :class:`NgramHasher`, history from lookback
    ids, a slot cache or a request history; returns whether it matched one-shot hashing."""
    import numpy as np

    from engramrt.config import load_config
    from engramrt.hashing import HashConstants, NgramHasher, hash_sequence
    from engramrt.hashing.stream import stream_sequence
    from engramrt.tokenmap import TokenMap

    history = "lookback" if run.history is None else run.history
    cfg = load_config(loaded.text)
    token_map = TokenMap.from_tokenizer_file(run.tokenizer)
    token_ids = run.token_ids()
    hasher = NgramHasher.from_config(
        cfg, token_map, run.device, backend=run.backend, check_ids=True
    )
    row_ids = stream_sequence(hasher, token_ids, run.chunk_sizes, history=history)
    consts = HashConstants.from_config(cfg, token_map)
    compressed = token_map.compress(token_ids)
    matches = bool(np.array_equal(row_ids, hash_sequence(compressed, consts)))
    if run.out is not None:
        save_row_ids(run.out, row_ids)
    if run.as_json:
        report = {
            "family": loaded.family,
            "token_ids": token_ids.tolist(),
            "compressed_ids": compressed.tolist(),
            "layer_ids": list(cfg.layer_ids),
            "row_ids": row_ids.tolist(),
            "matches_one_shot": matches,
            "backend": hasher.backend,
        }
        print(json.dumps(report))
        return matches
    from rich.table import Table

    from engramrt.cli._console import console

    table = Table(
        title=f"row ids, layer {cfg.layer_ids[0]} (first 16 tokens, 2-gram head 0 / 3-gram head 0 / 4-gram head 0)"
    )
    for name in ("pos", "token", "compressed", "2-gram", "3-gram", "4-gram"):
        table.add_column(name, justify="right")
    h = cfg.n_heads
    for p in range(min(16, token_ids.shape[0])):
        table.add_row(
            str(p),
            str(token_ids[p]),
            str(compressed[p]),
            *(f"{row_ids[p, 0, o * h]:,}" for o in range(cfg.max_ngram_size - 1)),
        )
    console.print(table)
    print_match(
        run,
        f"{token_ids.shape[0]} tokens, chunks {run.chunk_sizes or 'all at once'}, history "
        f"{history}, backend {hasher.backend}",
        row_ids,
        matches,
    )
    return matches


_RUNNERS: dict[str, Callable[[HashRun, FamilyConfig], bool]] = {
    "deepseek-engram": _hash_engram,
}
"""The CLI's own runner; other families' are their command-line hooks' ``hash_run``."""


def register(app: typer.Typer) -> None:
    @app.command("hash")
    def hash_command(
        config: FamilyConfigOption = "dsv41-flash",
        tokenizer: Annotated[
            Path | None,
            typer.Option(help="tokenizer.json (default DeepSeek-V4; Qwen4-Exp --text needs one)."),
        ] = None,
        text: Annotated[
            str | None, typer.Option(help="Text to tokenize (no special tokens added).")
        ] = None,
        ids: Annotated[str | None, typer.Option(help="Token ids, e.g. 1,2,3.")] = None,
        ids_file: Annotated[Path | None, typer.Option(help="A .npy file of token ids.")] = None,
        chunks: Annotated[
            str | None, typer.Option(help="Chunk sizes, e.g. 5,1,1 (rest: one chunk).")
        ] = None,
        history: Annotated[
            str | None,
            typer.Option(help="lookback (default), slot or request (DeepSeek Engram only)."),
        ] = None,
        backend: Annotated[str, typer.Option(help="auto, reference or triton.")] = "auto",
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
        out: Annotated[
            Path | None, typer.Option(help="Save row ids [T, L, C] int64 as .npy.")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Hash one sequence through the streaming path and check it against one-shot hashing
        (DeepSeek Engram: compressed ids; Qwen4-Exp: the PLE row ids of every PLE layer)."""
        from engramrt.cli._checks import check_output_path, parse_device, parse_int_list
        from engramrt.cli._family_config import family_hook, load_family_config
        from engramrt.errors import ValidationError

        if sum(x is not None for x in (text, ids, ids_file)) != 1:
            raise ValidationError("give exactly one of --text, --ids or --ids-file")
        if out is not None:
            check_output_path("--out", out)
        dev = parse_device("--device", device)
        loaded = load_family_config("--config", config)
        runner = _RUNNERS.get(loaded.family) or family_hook(loaded, "hash_run", "engramrt hash")
        chunk_sizes = parse_int_list("--chunks", chunks) if chunks is not None else None
        run = HashRun(
            config, text, ids, ids_file, tokenizer, chunk_sizes, history, backend, dev, out, as_json
        )
        if not runner(run, loaded):
            raise typer.Exit(code=1)
