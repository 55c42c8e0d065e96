"""``engramrt convert``: quantise float Engram tables into fp8 + ue8m0 safetensors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from engramrt.checkpoint import ConversionPlan

_HELP = """Quantise float Engram tables (bf16/fp16/fp32) into fp8 e4m3fn + ue8m0 safetensors.

SRC is a .safetensors file or a directory of them (with or without
model.safetensors.index.json) holding one float table \\[num_embeddings, E] per
Engram layer; by default it is looked up as layers.{layer}.engram.embed.weight
(DeepSeek-V4.1's name), then layers.{layer}.engram.multi_head_embedding.embedding.weight,
each also with a model. prefix, then engram.{layer}.weight ({layer}: the block
index in engram_layer_ids). DST gets layers.{layer}.engram.embed.weight
(F8_E4M3) and layers.{layer}.engram.embed.weight_scale_inv (U8, or F8_E8M0
with --scales e8m0), the names DeepSeek-V4.1 checkpoints use. Override any of them
with --names FILE, a JSON object such as
{"source": "engram.{index}.weight", "weight": "...", "scale": "..."} ({index}:
position in engram_layer_ids; a value may also be a list of names to try or an
object mapping layer id to name).

With --tp 1, DST is a .safetensors file, or a directory that receives
engram.safetensors. With --tp N, DST is a directory that receives
engram-rank<r>-of-<N>.safetensors: each holds only that rank's rows and
records them in its metadata. Files appear only once complete.
"""


def _resolve_config(config: str | None, src: Path) -> str:
    """``--config``, else SRC's ``config.json`` when SRC is a model directory, else V4.1-Flash."""
    if config is not None:
        return config
    if src.is_dir() and (src / "config.json").is_file():
        return str(src / "config.json")
    return "dsv41-flash"


def _run(
    src: Path,
    dst: Path,
    config: str | None,
    tp: int,
    names: Path | None,
    block_rows: int | None,
    scales: str,
    device: str,
    quiet: bool,
) -> dict[str, Any]:
    from engramrt.checkpoint import load_names, plan_conversion
    from engramrt.checkpoint.writer import scale_dtype_code
    from engramrt.cli._checks import check_tp, os_error, parse_device
    from engramrt.config import load_config
    from engramrt.errors import CheckpointError, ValidationError

    if not src.exists():
        raise CheckpointError(f"SRC {str(src)!r} does not exist")
    if tp < 1:
        raise ValidationError(f"--tp={tp}; expected a tensor-parallel size >= 1")
    if block_rows is not None and block_rows < 1:
        raise ValidationError(f"--block-rows={block_rows}; expected a positive number of rows")
    scale_dtype_code(scales)
    compute_device = parse_device("--device", device)
    probe = dst.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() and probe != dst.absolute():
        raise ValidationError(
            f"DST={str(dst)!r} lies under {str(probe)!r}, which is a file; expected a path in a "
            f"directory"
        )
    try:
        config = _resolve_config(config, src)
        check_tp("--tp", tp, load_config(config).n_cols)
        plan = plan_conversion(
            src,
            dst,
            config,
            tp=tp,
            names=None if names is None else load_names(names),
            scale_dtype=scales,
        )
        return _convert(plan, block_rows, compute_device, quiet)
    except OSError as exc:
        raise os_error(f"converting {str(src)!r} into DST={str(dst)!r} failed", exc) from exc


def _convert(
    plan: ConversionPlan, block_rows: int | None, device: Any, quiet: bool
) -> dict[str, Any]:
    """Run a conversion ``plan`` with a progress bar on a terminal, then print what it
    wrote unless ``quiet``."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from engramrt.checkpoint import run_conversion
    from engramrt.cli._console import console, err_console

    start = time.perf_counter()
    progress = Progress(
        TextColumn("quantising"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        # Only a live bar: on a pipe or log file rich would print it once, at the end.
        disable=quiet or not err_console.is_terminal,
    )
    with progress:
        task = progress.add_task("convert", total=plan.num_rows)
        paths = run_conversion(
            plan,
            block_rows=block_rows,
            device=device,
            on_rows=lambda rows: progress.advance(task, rows),
        )
    seconds = time.perf_counter() - start
    if not quiet:
        cfg = plan.config
        console.print(
            f"wrote {len(paths)} file(s), {plan.num_rows:,} rows of E={cfg.head_dim} "
            f"({plan.nbytes / 2**30:,.3f} GiB) for layers {list(cfg.layer_ids)} of "
            f"{cfg.name} in {seconds:.1f} s:",
            highlight=False,
            soft_wrap=True,
        )
        for path in paths:
            console.print(f"  {path}", highlight=False, soft_wrap=True)
    return {"files": [str(p) for p in paths], "rows": plan.num_rows, "seconds": seconds}


def register(app: typer.Typer) -> None:
    @app.command(help=_HELP)
    def convert(
        src: Annotated[Path, typer.Argument(help="Float tables: a .safetensors file or a dir.")],
        dst: Annotated[Path, typer.Argument(help="Output .safetensors file or directory.")],
        config: Annotated[
            str | None,
            typer.Option(
                "--config",
                "-c",
                help="Preset or config.json / model dir (default: SRC/config.json, else "
                "dsv41-flash).",
            ),
        ] = None,
        tp: Annotated[str, typer.Option(help="Write one file per tensor-parallel rank.")] = "1",
        names: Annotated[
            Path | None, typer.Option(help="JSON file overriding tensor names (see above).")
        ] = None,
        block_rows: Annotated[
            str | None,
            typer.Option(help="Rows read and quantised per block (default: ~64 MiB of fp32)."),
        ] = None,
        scales: Annotated[
            str, typer.Option(help="Scale dtype written: uint8 or e8m0 (same bytes).")
        ] = "uint8",
        device: Annotated[
            str, typer.Option(help="Device that quantises (cpu, cuda, cuda:1).")
        ] = "cpu",
        quiet: Annotated[
            bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")
        ] = False,
    ) -> None:
        import signal

        def _terminate(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)  # unwinds, so the conversion removes its temporaries

        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            from engramrt.cli._checks import parse_int, parse_optional_int

            _run(
                src,
                dst,
                config,
                parse_int("--tp", tp),
                names,
                parse_optional_int("--block-rows", block_rows),
                scales,
                device,
                quiet,
            )
        finally:
            signal.signal(signal.SIGTERM, previous)
