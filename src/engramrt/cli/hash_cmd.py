"""``engramrt hash``: row ids of one sequence, streamed in chunks like an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def _parse_ints(name: str, text: str) -> list[int]:
    from engramrt.errors import ValidationError

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise ValidationError(f"{name}={text!r} must be comma-separated integers") from exc


def register(app: typer.Typer) -> None:
    @app.command("hash")
    def hash_command(
        config: Annotated[
            str, typer.Option("--config", "-c", help="Preset or config.json.")
        ] = "dsv41-flash",
        tokenizer: Annotated[
            Path | None, typer.Option(help="tokenizer.json (default DeepSeek-V4).")
        ] = None,
        text: Annotated[
            str | None, typer.Option(help="Text to tokenize (no special tokens added).")
        ] = None,
        ids: Annotated[str | None, typer.Option(help="Token ids, e.g. 1,2,3.")] = None,
        ids_file: Annotated[Path | None, typer.Option(help="A .npy file of token ids.")] = None,
        chunks: Annotated[
            str | None, typer.Option(help="Chunk sizes, e.g. 5,1,1 (rest: one chunk).")
        ] = None,
        history: Annotated[str, typer.Option(help="lookback, slot or request.")] = "lookback",
        backend: Annotated[str, typer.Option(help="auto, reference or triton.")] = "auto",
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
        out: Annotated[
            Path | None, typer.Option(help="Save row ids [T, L, C] int64 as .npy.")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Hash one sequence through the streaming path and check it against one-shot hashing."""
        import io

        import numpy as np

        from engramrt.config import load_config
        from engramrt.errors import EngramError, ValidationError
        from engramrt.hashing import HashConstants, NgramHasher, hash_sequence
        from engramrt.hashing.stream import stream_sequence
        from engramrt.tokenmap import TokenMap, load_tokenizer

        given = [x is not None for x in (text, ids, ids_file)]
        if sum(given) != 1:
            raise ValidationError("give exactly one of --text, --ids or --ids-file")
        cfg = load_config(config)
        token_map = TokenMap.from_tokenizer_file(tokenizer)
        if text is not None:
            token_ids = np.array(
                load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids, np.int64
            )
        elif ids is not None:
            token_ids = np.array(_parse_ints("--ids", ids), dtype=np.int64)
        else:
            assert ids_file is not None
            try:
                token_ids = np.load(ids_file, allow_pickle=False).astype(np.int64).reshape(-1)
            except (OSError, ValueError) as exc:
                raise ValidationError(
                    f"--ids-file {str(ids_file)!r} is not a readable .npy: {exc}"
                ) from exc
        chunk_sizes = _parse_ints("--chunks", chunks) if chunks else None
        try:
            import torch

            dev = torch.device(device)
        except RuntimeError as exc:
            raise EngramError(f"--device {device!r} is not a torch device: {exc}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngramError("--device cuda but no CUDA device is visible")
        hasher = NgramHasher.from_config(cfg, token_map, dev, backend=backend)
        row_ids = stream_sequence(hasher, token_ids, chunk_sizes, history=history)
        consts = HashConstants.from_config(cfg, token_map)
        one_shot = hash_sequence(token_map.compress(token_ids), consts)
        matches = bool(np.array_equal(row_ids, one_shot))
        if out is not None:
            from engramrt._io import atomic_write_bytes

            buf = io.BytesIO()
            np.save(buf, row_ids)
            atomic_write_bytes(out, buf.getvalue())
        if as_json:
            print(
                json.dumps(
                    {
                        "token_ids": token_ids.tolist(),
                        "compressed_ids": token_map.compress(token_ids).tolist(),
                        "layer_ids": list(cfg.layer_ids),
                        "row_ids": row_ids.tolist(),
                        "matches_one_shot": matches,
                        "backend": hasher.backend,
                    }
                )
            )
        else:
            from rich.table import Table

            from engramrt.cli import console

            table = Table(
                title=f"row ids, layer {cfg.layer_ids[0]} (first 16 tokens, 2-gram head 0 / 3-gram head 0 / 4-gram head 0)"
            )
            for name in ("pos", "token", "compressed", "2-gram", "3-gram", "4-gram"):
                table.add_column(name, justify="right")
            comp = token_map.compress(token_ids)
            h = cfg.n_heads
            for p in range(min(16, token_ids.shape[0])):
                table.add_row(
                    str(p),
                    str(token_ids[p]),
                    str(comp[p]),
                    *(f"{row_ids[p, 0, o * h]:,}" for o in range(cfg.max_ngram_size - 1)),
                )
            console.print(table)
            console.print(
                f"{token_ids.shape[0]} tokens, chunks {chunk_sizes or 'all at once'}, history "
                f"{history}, backend {hasher.backend}: "
                + (
                    "[green]matches one-shot hashing[/]"
                    if matches
                    else "[red]DIFFERS from one-shot hashing[/]"
                )
            )
            if out is not None:
                console.print(f"saved {list(row_ids.shape)} int64 to {out}")
        if not matches:
            raise typer.Exit(code=1)
