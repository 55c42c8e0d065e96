"""``engramrt convert``: quantise float Engram tables into fp8 + ue8m0 safetensors, or split
a Qwen4-Exp checkpoint's bf16 PLE tables into per-rank files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from engramrt.checkpoint import ConversionPlan
    from engramrt.cli._family_config import FamilyConfig
    from engramrt.families.qwen4_ple.convert import PleConversionPlan

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

A Qwen4-Exp config (model_type qwen4_exp, or the ple_* fields; from --config or
SRC/config.json) converts its PLE tables instead: each rank's values of every
row (the TP plan embedding_colwise), bf16 as stored, into ple.safetensors
(--tp 1) or ple-rank<r>-of-<N>.safetensors, with the family, each layer, the
rank's value range and the config's fingerprint in the metadata;
load_ple_tables reads them. Nothing is quantised, so --scales, --names and
--device do not apply and are refused.
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
    scales: str | None,
    device: str | None,
    quiet: bool,
) -> dict[str, Any]:
    from engramrt.checkpoint import load_names, plan_conversion
    from engramrt.checkpoint.writer import scale_dtype_code
    from engramrt.cli._checks import check_tp, os_error, parse_device
    from engramrt.cli._family_config import load_family_config
    from engramrt.config import load_config
    from engramrt.errors import CheckpointError, ValidationError

    if not src.exists():
        raise CheckpointError(f"SRC {str(src)!r} does not exist")
    if tp < 1:
        raise ValidationError(f"--tp={tp}; expected a tensor-parallel size >= 1")
    if block_rows is not None and block_rows < 1:
        raise ValidationError(f"--block-rows={block_rows}; expected a positive number of rows")
    probe = dst.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() and probe != dst.absolute():
        raise ValidationError(
            f"DST={str(dst)!r} lies under {str(probe)!r}, which is a file; expected a path in a "
            f"directory"
        )
    loaded = load_family_config("--config", _resolve_config(config, src))
    if loaded.family == "qwen4-ple":
        _refuse_engram_options(loaded, names=names, scales=scales, device=device)
        return _run_ple(src, dst, loaded, tp, block_rows, quiet)
    scales = "uint8" if scales is None else scales
    scale_dtype_code(scales)
    compute_device = parse_device("--device", "cpu" if device is None else device)
    try:
        check_tp("--tp", tp, load_config(loaded.text).n_cols)
        plan = plan_conversion(
            src,
            dst,
            loaded.text,
            tp=tp,
            names=None if names is None else load_names(names),
            scale_dtype=scales,
        )
        return _convert(plan, block_rows, compute_device, quiet)
    except OSError as exc:
        raise os_error(f"converting {str(src)!r} into DST={str(dst)!r} failed", exc) from exc


def _refuse_engram_options(loaded: FamilyConfig, **given: Any) -> None:
    """Refuse the options of an fp8 Engram conversion in a Qwen4-Exp PLE one, naming each."""
    from engramrt.errors import ValidationError

    found = [f"--{option}={value}" for option, value in given.items() if value is not None]
    if found:
        raise ValidationError(
            f"{', '.join(found)} given with {loaded.option}={loaded.text!r}, a Qwen4-Exp config: "
            f"its PLE tables are copied in bf16 (no fp8 values, no scales, nothing computed) "
            f"under their own names; expected none of --scales, --names, --device"
        )


def _run_ple(
    src: Path, dst: Path, loaded: FamilyConfig, tp: int, block_rows: int | None, quiet: bool
) -> dict[str, Any]:
    from engramrt.cli._checks import os_error
    from engramrt.cli._family_config import ple_config
    from engramrt.families.qwen4_ple.convert import plan_ple_conversion, run_ple_conversion

    try:
        plan = plan_ple_conversion(src, dst, ple_config(loaded), tp=tp)
        paths, seconds = _with_progress(
            "copying",
            plan.num_rows,
            quiet,
            lambda on_rows: run_ple_conversion(plan, block_rows=block_rows, on_rows=on_rows),
        )
    except OSError as exc:
        raise os_error(f"converting {str(src)!r} into DST={str(dst)!r} failed", exc) from exc
    if not quiet:
        _print_ple_summary(plan, paths, seconds)
    return {"files": [str(p) for p in paths], "rows": plan.num_rows, "seconds": seconds}


def _print_ple_summary(plan: PleConversionPlan, paths: list[Path], seconds: float) -> None:
    cfg = plan.family.config
    _print_written(
        f"wrote {len(paths)} file(s), {plan.num_rows:,} bf16 rows of PLE tables (d="
        f"{cfg.table_width}, split over tp={plan.tp}; {plan.nbytes / 2**30:,.3f} GiB) for PLE "
        f"layers {list(cfg.ple_layer_ids)} in {seconds:.1f} s:",
        paths,
    )


def _print_written(summary: str, paths: list[Path]) -> None:
    """A conversion's summary line, then each file it wrote."""
    from engramrt.cli._console import console

    console.print(summary, highlight=False, soft_wrap=True)
    for path in paths:
        console.print(f"  {path}", highlight=False, soft_wrap=True)


def _with_progress(
    label: str, total: int, quiet: bool, run: Callable[[Callable[[int], None]], list[Path]]
) -> tuple[list[Path], float]:
    """``run(on_rows)`` under a progress bar of ``total`` rows on a terminal; returns what it
    wrote and the seconds it took."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from engramrt.cli._console import err_console

    start = time.perf_counter()
    progress = Progress(
        TextColumn(label),
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
        task = progress.add_task("convert", total=total)
        paths = run(lambda rows: progress.advance(task, rows))
    return paths, time.perf_counter() - start


def _convert(
    plan: ConversionPlan, block_rows: int | None, device: Any, quiet: bool
) -> dict[str, Any]:
    """Run a conversion ``plan`` with a progress bar on a terminal, then print what it
    wrote unless ``quiet``."""
    from engramrt.checkpoint import run_conversion

    paths, seconds = _with_progress(
        "quantising",
        plan.num_rows,
        quiet,
        lambda on_rows: run_conversion(plan, block_rows=block_rows, device=device, on_rows=on_rows),
    )
    if not quiet:
        cfg = plan.config
        _print_written(
            f"wrote {len(paths)} file(s), {plan.num_rows:,} rows of E={cfg.head_dim} "
            f"({plan.nbytes / 2**30:,.3f} GiB) for layers {list(cfg.layer_ids)} of "
            f"{cfg.name} in {seconds:.1f} s:",
            paths,
        )
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
            str | None,
            typer.Option(help="Scale dtype written: uint8 (default) or e8m0 (same bytes)."),
        ] = None,
        device: Annotated[
            str | None,
            typer.Option(help="Device that quantises (cpu, the default; cuda, cuda:1)."),
        ] = None,
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
