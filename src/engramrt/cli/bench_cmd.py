"""``engramrt bench``: check, then time every registered case beside its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        group: Annotated[
            list[str] | None,
            typer.Option("--group", "-g", help="Only these groups (hash, lookup, gate, ...)."),
        ] = None,
        case: Annotated[
            list[str] | None,
            typer.Option(
                "--case", "-k", help="Only cases matching these patterns ('lookup/host/*')."
            ),
        ] = None,
        quick: Annotated[bool, typer.Option(help="Small shapes, a short run.")] = False,
        out: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
        markdown: Annotated[Path | None, typer.Option(help="Write a markdown table here.")] = None,
        device: Annotated[str, typer.Option(help="cuda or cpu.")] = "cuda",
    ) -> None:
        """Run the benchmark suite; a case whose check fails is reported as failed."""
        import torch

        from engramrt.bench.runner import markdown_table, run_cases
        from engramrt.errors import EngramError

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngramError(
                f"device={device!r} but no CUDA device is visible; benchmarks need a GPU"
            )
        report = run_cases(group, quick=quick, device=device, out=out, names=case)
        table = markdown_table(report)
        if markdown is not None:
            from engramrt._io import atomic_write_bytes

            atomic_write_bytes(markdown, (table + "\n").encode())
        print(table)
        failed = [c["name"] for c in report["cases"] if c.get("status") == "failed"]
        if failed:
            raise typer.Exit(code=1)
