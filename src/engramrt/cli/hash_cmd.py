"""``engramrt hash``: row ids of one sequence, streamed in chunks like an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def _load_ids_file(path: Path) -> Any:
    """The 1-D integer token ids of a ``.npy`` file (no pickles, no casting of floats or bools)."""
    import numpy as np

    from engramrt.cli._checks import os_error
    from engramrt.errors import ValidationError

    try:
        array = np.load(path, allow_pickle=False)
    except OSError as exc:
        raise os_error(f"--ids-file={str(path)!r} cannot be read", exc) from exc
    except ValueError as exc:
        raise ValidationError(f"--ids-file={str(path)!r} is not a readable .npy: {exc}") from exc
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu":
        found = getattr(array, "dtype", type(array).__name__)
        raise ValidationError(
            f"--ids-file={str(path)!r} holds {found}; expected integer token ids "
            f"(int32/int64/uint32 ...), not floats, bools or strings"
        )
    if array.ndim != 1:
        raise ValidationError(
            f"--ids-file={str(path)!r} has shape {list(array.shape)}; expected one sequence, "
            f"a 1-D array [T]"
        )
    if array.dtype.kind == "u" and array.size and int(array.max()) > 2**63 - 1:
        raise ValidationError(
            f"--ids-file={str(path)!r} holds {int(array.max())}, which does not fit int64"
        )
    return array.astype(np.int64)


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

        from engramrt.cli._checks import (
            check_output_path,
            parse_device,
            parse_int_list,
            write_output,
        )
        from engramrt.config import load_config
        from engramrt.errors import ValidationError
        from engramrt.hashing import HashConstants, NgramHasher, hash_sequence
        from engramrt.hashing.stream import stream_sequence
        from engramrt.tokenmap import TokenMap, load_tokenizer

        given = [x is not None for x in (text, ids, ids_file)]
        if sum(given) != 1:
            raise ValidationError("give exactly one of --text, --ids or --ids-file")
        if out is not None:
            check_output_path("--out", out)
        dev = parse_device("--device", device)
        cfg = load_config(config)
        token_map = TokenMap.from_tokenizer_file(tokenizer)
        if text is not None:
            token_ids = np.array(
                load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids, np.int64
            )
        elif ids is not None:
            token_ids = np.array(parse_int_list("--ids", ids), dtype=np.int64)
        else:
            assert ids_file is not None
            token_ids = _load_ids_file(ids_file)
        if token_ids.size == 0:
            given_as = (
                "--text" if text is not None else "--ids" if ids is not None else "--ids-file"
            )
            raise ValidationError(f"{given_as} gives no token; expected at least one token id")
        chunk_sizes = parse_int_list("--chunks", chunks) if chunks is not None else None
        hasher = NgramHasher.from_config(cfg, token_map, dev, backend=backend, check_ids=True)
        row_ids = stream_sequence(hasher, token_ids, chunk_sizes, history=history)
        consts = HashConstants.from_config(cfg, token_map)
        one_shot = hash_sequence(token_map.compress(token_ids), consts)
        matches = bool(np.array_equal(row_ids, one_shot))
        if out is not None:
            buf = io.BytesIO()
            np.save(buf, row_ids)
            write_output("--out", out, buf.getvalue())
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

            from engramrt.cli._console import console

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
